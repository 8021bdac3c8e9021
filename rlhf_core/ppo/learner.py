"""What applies PPO's gradients: one interface, a single-process and a DeepSpeed implementation.

The update (rlhf_core/ppo/update.py) computes the losses and hands them here; a `Learner` accumulates
each trained model's gradient (`backward`), and after a mini-batch's last micro-batch clips each model's
global gradient norm separately (paper 5.3.2, `clip_gradients`) and steps (`apply_gradients`). Between
the two the update refuses a NaN or infinite norm (`discard_gradients`, then `CollapseError`), so nothing
of that step is applied. `LocalLearner` is one AdamW with a "policy" and a "critic" parameter group;
under the `deepspeed` launcher `ppo.deepspeed_learner.PPOEngines` gives each model its own engine. Both
save and restore the checkpoint format of rlhf_core/training/checkpoint.py, and make the policy whole for
sampling (`whole_policy`: a ZeRO-3 engine's partitioned weights gathered once for a rollout).
"""

from __future__ import annotations

import math
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Literal, Protocol

import torch
from torch import Tensor, nn
from torch.optim import AdamW
from torch.optim.lr_scheduler import LRScheduler

from rlhf_core.config import DistributedConfig, PPOConfig
from rlhf_core.distributed.context import RankContext
from rlhf_core.training.checkpoint import TrainingState, load_checkpoint, save_checkpoint
from rlhf_core.training.schedules import build_scheduler
from rlhf_core.training.update import adamw

ModelName = Literal["policy", "critic"]


class Learner(Protocol):
    """Accumulates, clips and applies the gradients of the policy and the critic; everything PPO's
    update and trainer use of it."""

    def backward(self, name: ModelName, loss: Tensor) -> None:
        """Accumulate one micro-batch's gradient of `name`'s loss."""

    def discard_gradients(self) -> None:
        """Drop every accumulated gradient (before a non-finite step is refused)."""

    def clip_gradients(self, train_policy: bool) -> dict[str, float]:
        """Clip the mini-batch's gradient of the critic, and of the policy if `train_policy`, each to
        `max_grad_norm`; the norms before clipping (`<name>/grad_norm`)."""

    def apply_gradients(self) -> None:
        """Step with the clipped gradients, then clear them."""

    def whole_policy(self) -> AbstractContextManager[None]:
        """For sampling: the context in which the policy's weights are whole."""

    def save(self, root: Path, state: TrainingState, keep: int) -> Path:
        """Checkpoint the trained weights, optimizer state and `state` under `root`."""

    def restore(self, path: Path) -> TrainingState:
        """Restore a checkpoint saved by `save` in place."""


def build_ppo_optimizer(policy: nn.Module, critic: nn.Module, config: PPOConfig) -> AdamW:
    """One AdamW with a "policy" and a "critic" parameter group, each with its own learning rate.

    Adam's state is per parameter, so this is exactly two optimizers; one object keeps the checkpoint
    format of the shared training loop. No weight decay (the paper uses none for PPO).
    """
    groups = [
        {"params": _trainable(policy), "lr": config.policy_lr, "name": "policy"},
        {"params": _trainable(critic), "lr": config.critic_lr, "name": "critic"},
    ]
    return adamw(groups, weight_decay=0.0)


def _trainable(module: nn.Module) -> list[nn.Parameter]:
    return [p for p in module.parameters() if p.requires_grad]


class LocalLearner:
    """One process: AdamW (two parameter groups) and a constant learning rate."""

    def __init__(self, trainable: nn.ModuleDict, config: PPOConfig, total_steps: int) -> None:
        self.trainable = trainable
        self.max_grad_norm = config.max_grad_norm if config.max_grad_norm is not None else math.inf
        self.optimizer = build_ppo_optimizer(trainable["policy"], trainable["critic"], config)
        self.scheduler: LRScheduler = build_scheduler(self.optimizer, "warmup_constant", total_steps, 0.0, 1.0)

    def backward(self, name: ModelName, loss: Tensor) -> None:
        loss.backward()

    def discard_gradients(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def clip_gradients(self, train_policy: bool) -> dict[str, float]:
        stepped: list[ModelName] = ["critic", "policy"] if train_policy else ["critic"]
        return {
            f"{name}/grad_norm": float(
                torch.nn.utils.clip_grad_norm_(_trainable(self.trainable[name]), self.max_grad_norm)
            )
            for name in stepped
        }

    def apply_gradients(self) -> None:
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)

    def whole_policy(self) -> AbstractContextManager[None]:
        """Nothing to gather: the one process holds every weight."""
        return nullcontext()

    def save(self, root: Path, state: TrainingState, keep: int) -> Path:
        return save_checkpoint(root, state, self.trainable, self.optimizer, self.scheduler, keep)

    def restore(self, path: Path) -> TrainingState:
        return load_checkpoint(path, self.trainable, self.optimizer, self.scheduler)


def make_learner(
    trainable: nn.ModuleDict,
    config: PPOConfig,
    context: RankContext,
    total_steps: int,
    bf16: bool,
    distributed: DistributedConfig | None,
) -> Learner:
    """`LocalLearner` in one process; DeepSpeed engines in a process the launcher started."""
    if not context.is_distributed:
        return LocalLearner(trainable, config, total_steps)
    if distributed is None:
        raise ValueError(f"this process is rank {context.rank} of {context.world_size}: pass `distributed`")
    from rlhf_core.ppo.deepspeed_learner import PPOEngines  # imports deepspeed

    return PPOEngines(trainable["policy"], trainable["critic"], config, distributed, context, total_steps, bf16)
