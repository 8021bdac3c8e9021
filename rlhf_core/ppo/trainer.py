"""PPO-max training (paper section 5): the phases of an iteration, composed into a resumable run.

An iteration is rollout (`ExperienceMaker`), guard (`CollapseGuard`), update (`PPOUpdate` through a
`Learner`), with critic-only iterations first (`CriticPretraining`); `Validator` validates on held-out
prompts and `select_policy` picks the output installed as `<checkpoint_dir>/best/`. The phases, their
files and what spans ranks under the deepspeed launcher: docs/stages-ppo.md (its numbered steps, "Where
the code is", "Several ranks"). Only rank 0 logs and saves.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from torch import nn
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase

from rlhf_core.config import DistributedConfig, PPOConfig
from rlhf_core.distributed.context import rank_context
from rlhf_core.models.chat import Messages
from rlhf_core.models.heads import less_length_share
from rlhf_core.models.lora import make_trainable
from rlhf_core.ppo.critic import CriticPretraining
from rlhf_core.ppo.experience import Experience
from rlhf_core.ppo.experience_maker import ExperienceMaker, PPOModels
from rlhf_core.ppo.guard import CollapseError, CollapseGuard
from rlhf_core.ppo.learner import make_learner
from rlhf_core.ppo.monitors import Metrics, SampleTable, sample_rows
from rlhf_core.ppo.ptx import PtxStream
from rlhf_core.ppo.scoring import fit_length_residual, reward_model_of, scored_reply_tokens
from rlhf_core.ppo.selection import Selection, ValidationRecord
from rlhf_core.ppo.update import PPOUpdate
from rlhf_core.ppo.validation import ValidationReplies, Validator
from rlhf_core.progress import bars_enabled
from rlhf_core.rollout.engine import RolloutEngine
from rlhf_core.training.checkpoint import TrainingState, latest_checkpoint
from rlhf_core.training.logger import MetricsLogger, NullLogger, RewindableLogger
from rlhf_core.training.loop import seed_everything
from rlhf_core.training.precision import autocast
from rlhf_core.training.vocabulary_gradients import accumulate_vocabulary_gradients_in_place

SAMPLES_PER_TABLE = 4


@dataclass(frozen=True)
class PPOData:
    """Prompts to train on and to validate on (held out of training), and SFT pairs for PPO-ptx."""

    prompts: Sequence[Messages]
    val_prompts: Sequence[Messages]
    ptx_examples: Sequence[tuple[Messages, str]] = ()
    val_prompt_ids: Sequence[str] = ()  # ids of `val_prompts` (for the record); default: their positions


class PPOTrainer:
    """The models, the phases of an iteration and the run's state.

    Its state (`state_dict`) is everything besides weights, optimizer and RNG that an exact resume needs:
    running score statistics, the guard's baseline, the positions in the prompt and SFT streams, the
    critic-pretraining phase and the validations so far.
    """

    def __init__(
        self,
        models: PPOModels,
        tokenizer: PreTrainedTokenizerBase,
        data: PPOData,
        config: PPOConfig,
        seed: int,
        bf16: bool = False,
        distributed: DistributedConfig | None = None,
        engine: RolloutEngine | None = None,
    ) -> None:
        """`engine` samples the rollouts (default: the one `config.rollout.engine` names; rlhf_core/rollout/)."""
        self.models = models
        self.tokenizer = tokenizer
        self.config = config
        self.seed = seed
        self.bf16 = bf16
        self.device = next(models.policy.parameters()).device
        models.reference.requires_grad_(False).eval()
        make_trainable(models.policy, config.trainable_top_layers, config.lora, seed)
        make_trainable(models.critic, config.trainable_top_layers, config.lora, seed, heads=[models.critic.value_head])
        self.context = rank_context()
        if not self.context.is_distributed:  # DeepSpeed takes each gradient from autograd itself
            accumulate_vocabulary_gradients_in_place(models.policy)
            accumulate_vocabulary_gradients_in_place(models.critic.backbone)
        self.trainable = nn.ModuleDict({"policy": models.policy, "critic": models.critic})
        self.critic_pretraining = CriticPretraining(config)
        self.learner = make_learner(self.trainable, config, self.context, self.total_steps, bf16, distributed)
        self.maker = ExperienceMaker(
            models,
            tokenizer,
            data.prompts,
            config,
            seed,
            self.context,
            self.learner.whole_policy,
            self._autocast,
            engine,
        )
        self.ptx = (
            PtxStream(data.ptx_examples, tokenizer, config, self.context, seed, self.device)
            if config.ptx_coef
            else None
        )
        self.update = PPOUpdate(
            self.trainable, config, self.learner, self.ptx, self.maker.experience_trunk, self._autocast
        )
        self.validator = Validator(self.maker, data.val_prompts, data.val_prompt_ids, config, seed, self.context)
        self.guard = CollapseGuard(config.guard)
        self.length_residual_slope: float | None = None  # `fit_length_residual` (length_residual: initial)

    def _autocast(self) -> AbstractContextManager[object]:
        return autocast(self.device, self.bf16)

    # ---- the phases ------------------------------------------------------------------------------

    @property
    def total_steps(self) -> int:
        """Iterations of the run: the critic-only ones first (at most `critic_pretrain_steps` while they
        last), then `steps` PPO iterations."""
        return self.critic_pretraining.iterations + self.config.steps

    def trains_policy(self, step: int) -> bool:
        """Whether iteration `step` (1-based) updates the policy: not during critic pretraining."""
        return self.critic_pretraining.trains_policy(step)

    def validates_after(self, step: int) -> bool:
        """Whether iteration `step` is followed by a validation: every `eval_every` PPO iterations and
        after the last (never during critic pretraining: the policy has not moved)."""
        if not self.trains_policy(step):
            return False
        ppo_step = step - self.critic_pretraining.iterations
        return ppo_step % self.config.eval_every == 0 or step == self.total_steps

    def rollout(self, step: int) -> tuple[Experience, Metrics]:
        """Phase 1 of iteration `step`: the next prompts' experience and all its monitors."""
        experience, metrics = self.maker.rollout()
        metrics["policy/updating"] = float(self.trains_policy(step))
        return experience, metrics

    def learn(self, experience: Experience, step: int) -> Metrics:
        """Phase 3: the update; a critic-only iteration may end critic pretraining."""
        train_policy = self.trains_policy(step)
        metrics = self.update.learn(experience, train_policy, step)
        if not train_policy:
            self.critic_pretraining.record(step, metrics["loss/value"])
        return metrics

    def fit_length_residual(self, replies: ValidationReplies) -> ValidationReplies:
        """`ppo.length_residual: initial`: fit the reward's slope on log reply length over the initial
        policy's replies to the held-out prompts and subtract it from every score of the run (scoring.py);
        returns `replies` scored as the rest of the run scores, without scoring them again."""
        slope = fit_length_residual(self.models.scorer, replies.scores, replies.mask)
        self.length_residual_slope = slope
        return replace(replies, scores=less_length_share(replies.scores, scored_reply_tokens(replies.mask), slope))

    # ---- state -----------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The run state besides weights, optimizer and RNG (plain numbers, checkpointable as is)."""
        return {
            **self.maker.state_dict(),
            **self.validator.state_dict(),
            "guard": self.guard.state_dict(),
            "ptx_steps_used": self.ptx.steps_used if self.ptx is not None else 0,
            **self.critic_pretraining.state_dict(),
            "length_residual_slope": self.length_residual_slope,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.maker.load_state_dict(state)
        self.validator.load_state_dict(state)
        self.guard.load_state_dict(state["guard"])
        if self.ptx is not None:
            self.ptx.steps_used = int(state["ptx_steps_used"])
        self.critic_pretraining.load_state_dict(state)
        slope = state.get("length_residual_slope")
        if slope is not None and self.length_residual_slope is None:  # the reward model is as loaded: add it once
            reward_model_of(self.models.scorer).length_slope += slope
        self.length_residual_slope = slope

    def save_checkpoint(self, root: Path, step: int, metrics: Metrics) -> Path:
        """Policy + critic weights, optimizer, scheduler, RNG states and `state_dict`, atomically."""
        state = TrainingState(step=step, best_metric=None, metrics=metrics, extra=self.state_dict())
        return self.learner.save(root, state, self.config.keep_checkpoints)

    def resume(self, root: Path) -> TrainingState:
        """Restore the newest complete checkpoint under `root` in place; step 0 when there is none."""
        latest = latest_checkpoint(root)
        if latest is None:
            return TrainingState(step=0)
        state = self.learner.restore(latest)
        self.load_state_dict(state.extra)
        if state.step > self.total_steps:
            raise ValueError(f"checkpoint {latest} is past the end of this run ({self.total_steps} iterations)")
        return state


# --------------------------------------------------------------------------------------------------
# the run


@dataclass(frozen=True)
class FitResult:
    """How a run ended. Step 0 is the initial (SFT) policy; `selection` names the policy in `best/`."""

    final_step: int  # the last iteration whose update was applied
    resumed_from: int
    total_steps: int
    critic_pretrain_steps: int  # critic-only iterations run (CriticPretraining)
    selection: Selection
    validations: list[ValidationRecord]
    metrics: Metrics  # the last logged iteration's monitors
    stop: CollapseError | None  # why the guard stopped the run, or None


def _rewind(logger: MetricsLogger, samples: SampleTable | None, step: int) -> None:
    """Drop history written after `step` by an interrupted run (everything, -1, on a fresh start)."""
    if isinstance(logger, RewindableLogger):
        logger.truncate_after(step)
    if samples is not None:
        samples.truncate_after(step)


def _finish_iteration(
    trainer: PPOTrainer, step: int, experience: Experience, metrics: Metrics, root: Path, samples: SampleTable | None
) -> None:
    """After iteration `step`'s update: the sample table and the validation when due, and `progress`."""
    if samples is not None and step % trainer.config.sample_table_every == 0:
        samples.write(step, sample_rows(experience, trainer.tokenizer, SAMPLES_PER_TABLE))
    if trainer.validates_after(step):
        validation, rewards = trainer.validator.validate()
        trainer.validator.record(step, validation, rewards, root)
        metrics.update(validation)
    metrics["progress"] = step / trainer.total_steps


def _start(trainer: PPOTrainer, root: Path, logger: MetricsLogger, samples: SampleTable | None) -> TrainingState:
    """Seed, resume from the newest checkpoint under `root` (the logs rewound to it) and, on a fresh run,
    fit the `ppo.length_residual: initial` slope (when set) and validate the initial policy at step 0;
    returns the state resumed."""
    # Each rank its own sampling stream (rank 0's is the single-process one); plans are seeded apart.
    seed_everything(trainer.seed + trainer.context.rank)
    state = trainer.resume(root)
    _rewind(logger, samples, state.step if state.step > 0 else -1)
    if state.step == 0:
        replies, fitted = trainer.validator.sample(), {}
        if trainer.config.length_residual == "initial":
            replies = trainer.fit_length_residual(replies)
            fitted["reward/length_residual_slope"] = trainer.length_residual_slope
        validation, rewards = trainer.validator.validate(replies)
        trainer.validator.record(0, validation, rewards, root)
        logger.log_metrics({**validation, **fitted, "progress": 0.0}, 0)
    return state


def fit(
    trainer: PPOTrainer,
    checkpoint_dir: str | Path,
    logger: MetricsLogger | None = None,
    samples: SampleTable | None = None,
    progress_bar: bool = False,
) -> FitResult:
    """Run (or resume) the whole PPO run; the selected policy ends up in `<checkpoint_dir>/best/`.

    Validates the initial policy at step 0 (the SFT baseline), then every `eval_every` PPO iterations
    and after the last; `PPOTrainer.select` then picks the output among the validated policies.
    Checkpoints every `checkpoint_every` iterations and after the last; a rerun resumes from the newest
    one and repeats exactly what the interrupted run would have done. When the collapse guard stops
    the run, the stopping iteration's monitors are logged and the result carries the `CollapseError`.
    """
    root = Path(checkpoint_dir)
    logger = logger if logger is not None else NullLogger()
    state = _start(trainer, root, logger, samples)
    metrics = dict(state.metrics)
    stop = None
    step = final_step = state.step
    show_progress = progress_bar and bars_enabled()  # a terminal, not RLHF_QUIET (rlhf_core/progress.py)
    with tqdm(total=trainer.total_steps, initial=step, disable=not show_progress, desc="ppo") as progress:
        while step < trainer.total_steps:
            step += 1
            experience, metrics = trainer.rollout(step)
            try:
                trainer.guard.check(metrics, step, initial_policy=not trainer.trains_policy(step - 1))
                metrics.update(trainer.learn(experience, step))
            except CollapseError as error:
                logger.log_metrics({**metrics, "guard/stopped": 1.0}, step)
                stop = error
                break
            progress.total = trainer.total_steps  # known once critic pretraining has ended
            _finish_iteration(trainer, step, experience, metrics, root, samples)
            logger.log_metrics(metrics, step)
            if step % trainer.config.checkpoint_every == 0 or step == trainer.total_steps:
                trainer.save_checkpoint(root, step, metrics)
            final_step = step
            progress.update(1)
            progress.set_postfix(reward=f"{metrics['reward/score_mean']:.3f}", kl=f"{metrics['kl/token_k3']:.3f}")
    selection = trainer.validator.select(root)
    return FitResult(
        final_step=final_step,
        resumed_from=state.step,
        total_steps=trainer.total_steps,
        critic_pretrain_steps=trainer.critic_pretraining.iterations_run(final_step),
        selection=selection,
        validations=list(trainer.validator.records),
        metrics=metrics,
        stop=stop,
    )
