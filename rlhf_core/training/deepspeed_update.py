"""One rank's optimizer steps through a DeepSpeed ZeRO engine (the multi-process `ModelUpdate`).

Gradient scaling, precisely. The loop normalises each micro-batch's loss by the GLOBAL step's totals
(tokens or pairs over all ranks), so the gradient it wants is the SUM over ranks and micro-batches of
the micro-batch gradients. A DeepSpeed engine instead AVERAGES gradients over the data-parallel ranks
(and, by default, divides each micro-batch's loss by the accumulation steps). So `backward` passes
`loss * world_size` with `scale_wrt_gas=False`: the engine's average is then exactly the wanted sum,
and W ranks with per-rank batch B apply the same update as one process with batch W * B.

The engine also clips the global gradient norm (`gradient_clipping`) and, when that norm is NaN or inf,
skips the optimizer step; `step` then raises `NonFiniteLossError`, like the single-process update
does before stepping. The engine's optimizer is AdamW over the same parameter groups and its lr
schedule the same function as in one process (the config is rendered by `deepspeed_config.py`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from rlhf_core.config import DistributedConfig
from rlhf_core.distributed.context import RankContext
from rlhf_core.distributed.deepspeed_config import EngineSettings, render_deepspeed_config
from rlhf_core.training.batching import BatchPlan
from rlhf_core.training.checkpoint import TrainingState
from rlhf_core.training.deepspeed_checkpoint import restore_engine_checkpoint, save_engine_checkpoint
from rlhf_core.training.loop_config import LoopConfig
from rlhf_core.training.schedules import build_scheduler
from rlhf_core.training.update import NonFiniteLossError, parameter_groups

ENGINE_NAME = "model"


def initialize_engine(
    model: nn.Module,
    groups: list[dict[str, Any]],
    ds_config: dict[str, Any],
    scheduler: Callable[[Optimizer], LRScheduler],
) -> Any:
    """`deepspeed.initialize` over `model`'s parameter `groups`; returns the engine.

    DeepSpeed builds the optimizer from `ds_config` (so ZeRO-Offload can use its CPU Adam) and calls
    `scheduler(optimizer)` to build the lr schedule on it.
    """
    import deepspeed

    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=groups, config=ds_config, lr_scheduler=scheduler
    )
    return engine


def uses_bf16(requested: bool) -> bool:
    """DeepSpeed bf16 (bf16 weights, fp32 master copies) only on CUDA; CPU ranks keep float32 weights and
    compute in bf16 through the loop's autocast, as one process does."""
    return requested and torch.cuda.is_available()


def grad_norm_of(engine: Any) -> float:
    """The engine's global gradient norm of its last step, before clipping (inf when it skipped one)."""
    norm = engine.get_global_grad_norm()
    if norm is None:
        raise RuntimeError("the DeepSpeed engine computed no gradient norm (zero_optimization.compute_grad_norm)")
    return float(norm)


class DeepSpeedUpdate:
    """The loop's `ModelUpdate` on one rank of a multi-process run: one DeepSpeed engine."""

    def __init__(self, engine: Any, context: RankContext, accumulation_steps: int) -> None:
        self.engine = engine
        self.context = context
        self.accumulation_steps = accumulation_steps
        self._pending = 0

    @classmethod
    def for_loop(
        cls,
        model: nn.Module,
        config: LoopConfig,
        plan: BatchPlan,
        total_steps: int,
        distributed: DistributedConfig,
        context: RankContext,
    ) -> DeepSpeedUpdate:
        """The engine the shared loop's `LoopConfig` and global `plan` call for on this rank."""
        if plan.accumulation_steps % context.world_size:
            raise ValueError(
                f"the batch plan has {plan.accumulation_steps} micro-batches per step, not a multiple of the "
                f"{context.world_size} ranks; build it with grad_accum_steps * world_size"
            )
        per_rank = plan.accumulation_steps // context.world_size
        settings = EngineSettings(
            micro_batch_size=plan.micro_batch_size or 1,  # nominal under token-budget batching
            grad_accum_steps=per_rank,
            lr=config.lr,
            max_grad_norm=config.max_grad_norm,
            weight_decay=config.weight_decay,
            betas=config.betas,
            eps=config.adam_eps,
        )
        ds_config = render_deepspeed_config(distributed, settings, context.world_size, uses_bf16(config.bf16))

        def scheduler(optimizer: Optimizer) -> LRScheduler:
            return build_scheduler(optimizer, config.schedule, total_steps, config.warmup_ratio, config.min_lr_ratio)

        engine = initialize_engine(model, parameter_groups(model, config.weight_decay), ds_config, scheduler)
        return cls(engine, context, per_rank)

    @property
    def model(self) -> nn.Module:
        return self.engine.module

    def lr(self) -> float:
        return self.engine.lr_scheduler.get_last_lr()[0]

    def backward(self, loss: Tensor) -> None:
        """Accumulate one micro-batch (the engine steps itself after the last of the step's micro-batches)."""
        self.engine.backward(loss * self.context.world_size, scale_wrt_gas=False)
        self.engine.step()
        self._pending += 1

    def discard_gradients(self) -> None:
        self.engine.zero_grad()

    def step(self, step: int) -> float:
        """Check the engine applied this step's update; raise if its gradient norm was not finite."""
        if self._pending != self.accumulation_steps:
            raise RuntimeError(
                f"step {step} ran {self._pending} micro-batches on rank {self.context.rank}, but the engine "
                f"accumulates {self.accumulation_steps}"
            )
        self._pending = 0
        grad_norm = grad_norm_of(self.engine)
        if not math.isfinite(grad_norm):  # the engine skipped the optimizer step
            raise NonFiniteLossError(step, grad_norm, "the gradient norm")
        return grad_norm

    def save(self, root: Path, state: TrainingState, keep: int | None) -> None:
        save_engine_checkpoint(root, state, {ENGINE_NAME: self.engine}, keep, self.context)

    def restore(self, path: Path) -> TrainingState:
        return restore_engine_checkpoint(path, {ENGINE_NAME: self.engine}, self.context)
