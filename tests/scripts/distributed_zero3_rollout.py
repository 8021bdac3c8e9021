"""What each rank runs in tests/distributed/test_distributed_zero3_gather.py: PPO rollouts of a ZeRO-3 policy.

Builds the PPO trainer of the stage (tiny SFT and reward-model outputs given on the command line) on a
2-rank ZeRO-3 process group, with the rollout engine `--engine` names, and counts, per rollout, how many
times the policy's weights are gathered whole (`GatheredParameters` entered) and how many all-gather
collectives run DURING the engine's `generate`; between the rollouts the policy takes an update step. As
a control it also generates once without the whole-model gather, where ZeRO-3 fetches every layer's
weights again for every new token, and it checks that the engine, synced after the update, draws the
tokens `generate` draws from the gathered, updated policy. Prints one line `ZERO3 <json>` per rank.
"""

import argparse
import collections
import json
from pathlib import Path

import torch
from deepspeed.comm import comm as ds_comm
from deepspeed.runtime.zero import GatheredParameters

from rlhf_core.config import Config, load_config
from rlhf_core.distributed.context import RankContext, end_rank_process, leave_process_group, stage_context
from rlhf_core.ppo.trainer import PPOTrainer
from rlhf_core.rollout.engine import HFGenerateEngine
from rlhf_core.rollout.generation import generate_responses, left_pad, sampling_config
from rlhf_core.rollout.lean_engine import LeanEngine
from rlhf_core.stages.ppo import load_ppo_data, load_ppo_models

ROOT = Path(__file__).resolve().parents[2]
counts: collections.Counter[str] = collections.Counter()


def count_calls(owner: object, name: str, counter: str) -> None:
    """Wrap `owner.name` so that every call adds 1 to `counts[counter]`."""
    original = getattr(owner, name)

    def counted(*args, **kwargs):
        counts[counter] += 1
        return original(*args, **kwargs)

    setattr(owner, name, counted)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data-dir", type=Path, required=True)
    parser.add_argument("--sft-dir", type=Path, required=True)
    parser.add_argument("--rm-dir", type=Path, required=True)
    parser.add_argument("--rollouts", type=int, required=True)
    parser.add_argument("--engine", choices=["hf", "lean"], required=True)
    return parser.parse_args()


def build_trainer(args: argparse.Namespace) -> tuple[Config, RankContext, PPOTrainer]:
    """The stage's PPO trainer of the tiny models on a 2-rank ZeRO-3 group (joined first), sampling with
    `--engine`."""
    config = load_config(
        ROOT / "params.yaml",
        overlays=[ROOT / "configs" / "tiny.yaml"],
        overrides=[
            "distributed.num_processes=2",
            "distributed.zero_stage=3",
            "ppo.ptx_coef=0",
            "ppo.rollout.max_new_tokens=8",
            f"ppo.rollout.engine={args.engine}",
            "ppo.rollout.sampler=multinomial",  # generate's draws: the engine's tokens are compared with its
        ],
    )
    context = stage_context(config.distributed)
    models, tokenizer = load_ppo_models(config, args.sft_dir, args.rm_dir, torch.device("cpu"))
    data = load_ppo_data(config, args.data_dir)
    trainer = PPOTrainer(models, tokenizer, data, config.ppo, config.seed, distributed=config.distributed)
    return config, context, trainer


def counted(generate, during_generate: list[int]):
    """`generate`, appending to `during_generate` how many all-gathers ran inside each call."""

    def counted_generate(*generate_args, **generate_kwargs):
        before = counts["all_gather"]
        output = generate(*generate_args, **generate_kwargs)
        during_generate.append(counts["all_gather"] - before)
        return output

    return counted_generate


def run_rollouts(trainer: PPOTrainer, rollouts: int, during_generate: list[int]) -> list[dict[str, int]]:
    """Rollouts with an update step after each: the whole-model gathers and the all-gathers in generate."""
    records = []
    for step in range(1, rollouts + 1):
        before = counts["whole_model_gathers"]
        experience, _ = trainer.rollout(step)
        records.append(
            {
                "whole_model_gathers": counts["whole_model_gathers"] - before,
                "all_gathers_during_generate": during_generate[-1],
                "generated_columns": int(experience.response_ids.shape[1]),
            }
        )
        trainer.learn(experience, step)
    return records


def compare_with_generate(config: Config, trainer: PPOTrainer, during_generate: list[int]) -> dict[str, object]:
    """The engine's tokens against `generate` on the gathered, updated policy (same seed), and the control:
    `generate` on the partitioned policy, layer by layer, every rank in step."""
    policy = trainer.models.policy
    prompt_ids, prompt_mask = left_pad(trainer.maker.next_prompts(), trainer.maker.pad_id)
    torch.manual_seed(11)
    engine_ids = trainer.maker.generate((prompt_ids, prompt_mask)).response_ids
    with torch.no_grad(), trainer.learner.whole_policy():
        torch.manual_seed(11)
        maker = trainer.maker
        reference_ids = generate_responses(
            policy, prompt_ids, prompt_mask, config.ppo.rollout, maker.stop_ids, maker.pad_id
        )[0]
    policy.generate = counted(policy.generate, during_generate)
    with torch.no_grad():
        control = policy.generate(
            input_ids=prompt_ids,
            attention_mask=prompt_mask,
            generation_config=sampling_config(config.ppo.rollout, trainer.maker.stop_ids, trainer.maker.pad_id),
            synced_gpus=True,
        )
    return {
        "control_all_gathers_during_generate": during_generate[-1],
        "control_generated_columns": int(control.shape[1] - prompt_ids.shape[1]),
        "same_tokens_as_generate_after_update": bool(torch.equal(engine_ids, reference_ids)),
    }


def main() -> None:
    args = parse_args()
    config, context, trainer = build_trainer(args)
    for name in ("all_gather", "all_gather_into_tensor", "all_gather_coalesced", "allgather_fn"):
        if hasattr(ds_comm.cdb, name):
            count_calls(ds_comm.cdb, name, "all_gather")
    count_calls(GatheredParameters, "__enter__", "whole_model_gathers")
    during_generate: list[int] = []
    engine_class = LeanEngine if args.engine == "lean" else HFGenerateEngine
    engine_class.generate = counted(engine_class.generate, during_generate)
    rollouts = run_rollouts(trainer, args.rollouts, during_generate)
    result = {
        "rank": context.rank,
        "world_size": context.world_size,
        "partitioned": all(hasattr(p, "ds_id") for p in trainer.models.policy.parameters()),
        "rollouts": rollouts,
        **compare_with_generate(config, trainer, during_generate),
    }
    print("ZERO3 " + json.dumps(result), flush=True)
    leave_process_group()  # as the stage worker does: exiting inside the group can abort a rank
    end_rank_process()


if __name__ == "__main__":
    main()
