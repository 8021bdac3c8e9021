"""PPO's two trained models as DeepSpeed engines on one rank of a multi-process run.

The single-process learner keeps the policy and the critic in one AdamW with two parameter groups
(rlhf_core/ppo/learner.py); under the launcher each gets its own engine, which is what lets each
clip its own gradient norm (paper 5.3.2: policy and critic are clipped separately) with its own
learning rate, and under ZeRO-3 partition its own weights. The frozen reference and reward models are
not engines: they are replicated on every rank (see infra/deepspeed/README.md for their memory).

Gradient scaling is the loop's (rlhf_core/training/deepspeed_update.py): every micro-batch loss is already normalised
by the
GLOBAL mini-batch's token count, so `backward` passes `loss * world_size` to an engine that averages
over ranks, without dividing by the accumulation steps.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Literal

from torch import Tensor, nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from rlhf_core.config import DistributedConfig, PPOConfig
from rlhf_core.distributed.context import RankContext
from rlhf_core.distributed.deepspeed_config import EngineSettings, render_deepspeed_config
from rlhf_core.distributed.zero import gathered_for_generation
from rlhf_core.training.checkpoint import TrainingState
from rlhf_core.training.deepspeed_checkpoint import restore_engine_checkpoint, save_engine_checkpoint
from rlhf_core.training.deepspeed_update import grad_norm_of, initialize_engine, uses_bf16
from rlhf_core.training.schedules import build_scheduler
from rlhf_core.training.update import parameter_groups

ModelName = Literal["policy", "critic"]  # ppo/learner.py's, restated: it imports this module (a cycle)


class PPOEngines:
    """The policy's and the critic's engines: the `rlhf_core.ppo.learner.Learner` of a launched rank."""

    def __init__(
        self,
        policy: nn.Module,
        critic: nn.Module,
        config: PPOConfig,
        distributed: DistributedConfig,
        context: RankContext,
        total_steps: int,
        bf16: bool,
    ) -> None:
        if config.mini_batch_size % config.micro_batch_size:
            raise ValueError("ppo.mini_batch_size must be a multiple of ppo.micro_batch_size")
        self.context = context
        self.accumulation_steps = config.mini_batch_size // config.micro_batch_size

        def engine(model: nn.Module, lr: float) -> Any:
            settings = EngineSettings(
                micro_batch_size=config.micro_batch_size,
                grad_accum_steps=self.accumulation_steps,
                lr=lr,
                max_grad_norm=config.max_grad_norm,
            )
            ds_config = render_deepspeed_config(distributed, settings, context.world_size, uses_bf16(bf16))

            def constant_lr(optimizer: Optimizer) -> LRScheduler:  # the single-process PPO schedule
                return build_scheduler(optimizer, "warmup_constant", total_steps, 0.0, 1.0)

            return initialize_engine(model, parameter_groups(model, 0.0), ds_config, constant_lr)

        self.engines: dict[ModelName, Any] = {
            "policy": engine(policy, config.policy_lr),
            "critic": engine(critic, config.critic_lr),
        }
        self._pending: dict[ModelName, int] = {"policy": 0, "critic": 0}

    def backward(self, name: ModelName, loss: Tensor) -> None:
        """Accumulate one micro-batch of `name`'s loss (its engine steps after the mini-batch's last)."""
        engine = self.engines[name]
        engine.backward(loss * self.context.world_size, scale_wrt_gas=False)
        engine.step()
        self._pending[name] += 1

    def discard_gradients(self) -> None:
        for engine in self.engines.values():
            engine.zero_grad()

    def clip_gradients(self, train_policy: bool) -> dict[str, float]:
        """The gradient norms (before clipping) of the engines that just stepped: critic, and policy
        unless critic-only. Each engine has already clipped and stepped in `backward`; infinite or NaN
        means it skipped that step (the update then stops the run)."""
        stepped: list[ModelName] = ["critic", "policy"] if train_policy else ["critic"]
        norms = {}
        for name in stepped:
            if self._pending[name] != self.accumulation_steps:
                raise RuntimeError(
                    f"the {name} ran {self._pending[name]} micro-batches on rank {self.context.rank}, "
                    f"but its engine accumulates {self.accumulation_steps}"
                )
            self._pending[name] = 0
            norms[f"{name}/grad_norm"] = grad_norm_of(self.engines[name])
        return norms

    def apply_gradients(self) -> None:
        """Nothing left to apply: each engine stepped at the mini-batch's last micro-batch, in `backward`."""

    def whole_policy(self) -> AbstractContextManager[None]:
        """The policy engine's module whole for the block: under ZeRO-3 gathered once, not per layer call."""
        return gathered_for_generation(self.engines["policy"])

    def save(self, root: Path, state: TrainingState, keep: int) -> Path:
        return save_engine_checkpoint(root, state, dict(self.engines), keep, self.context)

    def restore(self, path: Path) -> TrainingState:
        return restore_engine_checkpoint(path, dict(self.engines), self.context)
