"""Stage `judge-rm`: a second reward model, independent of the one PPO optimises against, to judge with.

Why: PPO maximises the score of its reward model, so that reward model judging PPO against SFT is an
in-sample judge: the policy was trained to please it, and its verdicts overstate the policy's quality
(paper section 6 judges with people and GPT-4 for this reason). This stage trains a judge that shares
no training pair with it:

- trained on ppo_pairs.parquet, the preference pairs of the PPO-prompt split, which the prompt-hash
  split keeps disjoint from rm_train (the policy reward model's pairs), rm_val and eval;
- selected on rm_val, like the policy reward model, and never on eval, the prompts it will judge;
- initialised from a base model, not from the SFT model: SFT trained on the chosen replies of the
  rm_train prompts, so an SFT-initialised judge would start from weights fitted to the policy reward
  model's training data. That base model is `evaluation.judge_base_model` when set (another model
  family, e.g. the packaged Gemma 3, with its own tokenizer: the judge reads replies as text), else the
  policy's base model `model`;
- with every other `reward` setting (lr, steps, batches, LoRA, ...) as the policy reward model has.

It is `run_train_rm` (stages/reward.py) with those two differences, in one process only: the deepspeed
worker (rlhf_core/stages/worker.py) launches the sft, reward and ppo stages, not this one.
"""

from __future__ import annotations

from pathlib import Path

from rlhf_core.config import Config
from rlhf_core.reward.training_data import TrainSplit
from rlhf_core.stages.result import StageResult
from rlhf_core.stages.reward import run_train_rm
from rlhf_core.training.logger import MetricsLogger

JUDGE_TRAIN_SPLIT: TrainSplit = "ppo_pairs"


def judge_config(config: Config) -> Config:
    """`config` with the reward model initialised from the judge's base model, which becomes its `model`
    section (see the module docstring), so every setting and cache key of the stage names what it trains."""
    judge_model = config.evaluation.judge_base_model or config.model
    reward = config.reward.model_copy(update={"init_from": "base"})
    return config.model_copy(update={"model": judge_model, "reward": reward})


def run_judge_rm(config: Config, data_dir: Path, out_dir: Path, logger: MetricsLogger | None = None) -> StageResult:
    """Train the judge reward model on the PPO-prompt split's pairs into `out_dir` (model/, metrics.json, ...)."""
    if config.distributed.world_size > 1:
        raise ValueError(
            f"the judge reward model trains in one process, but distributed.num_processes * num_nodes = "
            f"{config.distributed.world_size}; set distributed.num_processes: 1 (and num_nodes: 1) to train it, "
            "or evaluation.judge_rm: in_sample"
        )
    return run_train_rm(judge_config(config), data_dir, None, out_dir, logger, train_split=JUDGE_TRAIN_SPLIT)
