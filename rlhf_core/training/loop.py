"""The shared training loop: seeded, gradient-accumulating, checkpointed and exactly resumable.

Steps are 1-based: step `s` is the `s`-th optimizer update; it trains on `plan.step(s - 1)` and runs at
the lr multiplier `schedule(s - 1)`. A checkpoint named `step-s` holds the state after update `s`, and a
rerun of the same `train(...)` call with the same checkpoint directory restores it (weights, optimizer,
scheduler, RNG states, best metric, extra state), cuts the logger's history back to `s` and continues at
`s + 1`, reproducing an uninterrupted run exactly. A NaN/inf loss or gradient norm raises
`NonFiniteLossError` (naming the step) before the optimizer steps, so no bad update is ever applied.

The loss contract (what makes micro-batching invisible to the update):

* `count_units(micro_batch) -> {unit: count}` counts what the loss is averaged over: `{"tokens": n}` for
  SFT, `{"pairs": p, "tokens": n}` for the reward model. Before any forward pass the loop sums these
  counts over all micro-batches of the optimizer step into `totals`.
* `loss_fn(model, micro_batch, totals) -> (loss, metrics)` returns the micro-batch's SUM of per-unit
  losses divided by the step's totals (e.g. `sum of token NLLs / totals["tokens"]`, or for the reward
  model `sum of pair ranking losses / totals["pairs"] + beta * sum of token NLLs / totals["tokens"]`).
  The loop calls `loss.backward()` on each, so the accumulated gradient is the gradient of the whole
  step's mean: the same update whatever the split into micro-batches. Averaging inside each micro-batch
  instead would weight a token by 1 / (tokens in its micro-batch), which changes with the split.
* `metrics` must be normalised the same way (by `totals`); the loop SUMS them over the micro-batches to
  get the step's values. The loop adds `loss`, `grad_norm` (before clipping), `lr` and `epoch`.

Several ranks (a stage started by the `deepspeed` launcher, rlhf_core/distributed): the plan describes
the GLOBAL batch and each rank trains every `world_size`-th micro-batch of each step
(`distributed.sharding`). `totals` are summed over all ranks before any forward pass, so each rank's
loss is its share of the global step's mean; a DeepSpeed engine sums the ranks' gradients (see
`training.deepspeed_update`), and the logged metrics are summed over ranks too. W ranks with a plan of
`W * A` micro-batches per step therefore apply the same update as one process with that plan. Every
rank validates (on the same batches: with ZeRO-3 a forward pass needs all ranks), only rank 0 logs,
shows progress and calls `on_best`.
"""

import logging
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal, Protocol, TypeVar

import numpy as np
import torch
from torch import Tensor, nn
from torch.optim import AdamW
from tqdm.auto import tqdm

from rlhf_core.config import DistributedConfig
from rlhf_core.distributed.collectives import sum_counts, sum_metrics
from rlhf_core.distributed.context import RankContext, init_process_group, rank_context
from rlhf_core.distributed.sharding import shard
from rlhf_core.distributed.zero import gathered_parameters
from rlhf_core.progress import bars_enabled
from rlhf_core.training.batching import BatchPlan
from rlhf_core.training.checkpoint import TrainingState, checkpoint_step, latest_checkpoint
from rlhf_core.training.logger import MetricsLogger, NullLogger, RewindableLogger
from rlhf_core.training.loop_config import LoopConfig
from rlhf_core.training.precision import autocast
from rlhf_core.training.update import LocalUpdate, ModelUpdate, NonFiniteLossError, build_adamw

log = logging.getLogger(__name__)
Batch = TypeVar("Batch")
UnitCounts = dict[str, int]
Metrics = dict[str, float]


class SupportsStateDict(Protocol):
    """Extra state the caller wants checkpointed with the loop (e.g. running reward statistics)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass(frozen=True)
class TrainResult:
    """What a `train` call ends with. `resumed_from` is the restored checkpoint's step (0: fresh start)."""

    final_step: int
    resumed_from: int
    metrics: Metrics
    best_metric: float | None


def total_steps(config: LoopConfig, plan: BatchPlan) -> int:
    """`ceil(epochs * steps_per_epoch)`, capped by `max_steps`."""
    steps = math.ceil(config.epochs * plan.steps_per_epoch)
    return steps if config.max_steps is None else min(steps, config.max_steps)


def seed_everything(seed: int) -> None:
    """Seed python `random`, numpy's global generator and torch (CPU and every CUDA device)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def build_optimizer(model: nn.Module, config: LoopConfig) -> AdamW:
    """AdamW over the trainable parameters; 1-d tensors (biases, norm weights) get no weight decay."""
    return build_adamw(model, config.lr, config.weight_decay, config.betas, config.adam_eps)


def build_update(
    model: nn.Module,
    config: LoopConfig,
    plan: BatchPlan,
    total: int,
    distributed: DistributedConfig | None,
    context: RankContext,
) -> ModelUpdate:
    """In-process AdamW for a world of 1; a DeepSpeed ZeRO engine per `distributed` for more ranks."""
    if not context.is_distributed:
        return LocalUpdate(
            model,
            build_optimizer(model, config),
            config.schedule,
            total,
            config.warmup_ratio,
            config.min_lr_ratio,
            config.max_grad_norm,
        )
    if distributed is None:
        raise ValueError(f"this process is rank {context.rank} of {context.world_size}: pass `distributed`")
    from rlhf_core.training.deepspeed_update import DeepSpeedUpdate  # imports deepspeed

    return DeepSpeedUpdate.for_loop(model, config, plan, total, distributed, context)


def sum_unit_counts(counts: list[UnitCounts]) -> UnitCounts:
    """Add up the unit counts of one optimizer step's micro-batches (all must count the same units)."""
    totals = dict.fromkeys(counts[0], 0)
    for index, count in enumerate(counts):
        if count.keys() != totals.keys():
            raise ValueError(f"micro-batch {index} counts units {sorted(count)}, expected {sorted(totals)}")
        for unit, value in count.items():
            totals[unit] += int(value)
    return totals


def optimizer_step(
    update: ModelUpdate,
    micro_batches: list[Batch],
    count_units: Callable[[Batch], UnitCounts],
    loss_fn: Callable[[nn.Module, Batch, UnitCounts], tuple[Tensor, Metrics]],
    step: int,
    config: LoopConfig,
) -> Metrics:
    """One accumulated update: backward every micro-batch against the step's totals, then step.

    `micro_batches` are this rank's; `totals`, the loss and the metrics are summed over all ranks
    (a no-op for one rank), so they describe the whole global step.
    """
    totals = sum_counts(sum_unit_counts([count_units(batch) for batch in micro_batches]))
    model = update.model
    device = next(model.parameters()).device
    metrics: Metrics = {}
    loss_sum = 0.0
    lr = update.lr()
    for index, batch in enumerate(micro_batches):
        with autocast(device, config.bf16):
            loss, batch_metrics = loss_fn(model, batch, totals)
        value = loss.item()
        if not math.isfinite(value):
            update.discard_gradients()
            raise NonFiniteLossError(step, value, f"the loss of micro-batch {index}")
        update.backward(loss)
        loss_sum += value
        for name, metric in batch_metrics.items():
            metrics[name] = metrics.get(name, 0.0) + float(metric)
    grad_norm = update.step(step)
    return {**sum_metrics({**metrics, "loss": loss_sum}), "grad_norm": grad_norm, "lr": lr}


def run_evaluation(
    model: nn.Module, evaluate: Callable[[nn.Module, int | None], Metrics], max_batches: int | None, bf16: bool
) -> Metrics:
    """Call `evaluate(model, max_batches)` in eval mode without gradients, then return to train mode."""
    model.eval()
    try:
        with torch.no_grad(), autocast(next(model.parameters()).device, bf16):
            return evaluate(model, max_batches)
    finally:
        model.train()


def is_improvement(value: float, best: float | None, mode: Literal["max", "min"]) -> bool:
    """Whether `value` beats `best` (anything beats None)."""
    if best is None:
        return True
    return value > best if mode == "max" else value < best


def resume(
    checkpoint_dir: Path | None, update: ModelUpdate, extra_state: SupportsStateDict | None, total: int
) -> TrainingState:
    """Restore the newest complete checkpoint in place, or return the state of a fresh start (step 0)."""
    latest = latest_checkpoint(checkpoint_dir) if checkpoint_dir is not None else None
    if latest is None:
        return TrainingState(step=0)
    if checkpoint_step(latest) > total:
        raise ValueError(f"checkpoint {latest} is past the end of training ({total} steps)")
    state = update.restore(latest)
    if extra_state is not None:
        extra_state.load_state_dict(state.extra)
    return state


def _evaluate_step(
    model: nn.Module,
    step: int,
    total: int,
    config: LoopConfig,
    evaluate: Callable[[nn.Module, int | None], Metrics] | None,
) -> Metrics | None:
    """Periodic validation on `eval_batches` batches, full validation after the last step, else None."""
    if evaluate is None:
        return None
    if step == total:
        return run_evaluation(model, evaluate, None, config.bf16)
    if config.eval_every is not None and step % config.eval_every == 0:
        return run_evaluation(model, evaluate, config.eval_batches, config.bf16)
    return None


def _track_best(
    update: ModelUpdate,
    step: int,
    metrics: Metrics,
    best: float | None,
    select_best: tuple[str, Literal["max", "min"]] | None,
    on_best: Callable[[nn.Module, int, Metrics], None] | None,
    context: RankContext,
) -> float | None:
    """The best value of the selected metric after this validation; rank 0 calls `on_best` when it improved.

    Every rank decides alike (the validation metrics are the same on all ranks) and enters the gather
    of ZeRO-3 partitioned weights, which is collective; only rank 0 writes.
    """
    if select_best is None:
        return best
    name, mode = select_best
    if name not in metrics:
        raise KeyError(f"select_best metric {name!r} is not among the metrics {sorted(metrics)}")
    if not is_improvement(metrics[name], best, mode):
        return best
    if on_best is not None:
        with gathered_parameters(update.model):
            if context.is_main:
                on_best(update.model, step, metrics)
    return metrics[name]


def _checkpoint_due(step: int, total: int, config: LoopConfig) -> bool:
    """Every `checkpoint_every` steps, and always after the last step (so a rerun finds the run finished)."""
    every = config.checkpoint_every
    return step == total or (every is not None and step % every == 0)


def _checkpoint(
    root: Path, state: TrainingState, update: ModelUpdate, extra_state: SupportsStateDict | None, config: LoopConfig
) -> None:
    """Save `state` plus the caller's extra state, keeping the newest `keep_checkpoints`."""
    extra = extra_state.state_dict() if extra_state is not None else {}
    update.save(root, replace(state, extra=extra), config.keep_checkpoints)


def _resume_logged(
    checkpoint_root: Path | None,
    update: ModelUpdate,
    extra_state: SupportsStateDict | None,
    total: int,
    logger: MetricsLogger,
    config: LoopConfig,
) -> TrainingState:
    """Resume from the newest checkpoint (step 0 without one), rewind the logger's history to it and log
    the loop's settings."""
    state = resume(checkpoint_root, update, extra_state, total)
    if isinstance(logger, RewindableLogger):
        logger.truncate_after(state.step)
    logger.log_params({"loop": config.model_dump(mode="json"), "total_steps": total})
    return state


def _rank_micro_batches(
    plan: BatchPlan, step: int, collate: Callable[[list[int]], Batch], context: RankContext
) -> list[Batch]:
    """This rank's share of optimizer step `step`'s micro-batches (1-based steps), collated."""
    rank_indices = shard(plan.step(step - 1), context)
    log.debug("rank %d of %d, step %d: examples %s", context.rank, context.world_size, step, rank_indices)
    return [collate(indices) for indices in rank_indices]


def train(
    model: nn.Module,
    plan: BatchPlan,
    collate: Callable[[list[int]], Batch],
    count_units: Callable[[Batch], UnitCounts],
    loss_fn: Callable[[nn.Module, Batch, UnitCounts], tuple[Tensor, Metrics]],
    config: LoopConfig,
    *,
    evaluate: Callable[[nn.Module, int | None], Metrics] | None = None,
    select_best: tuple[str, Literal["max", "min"]] | None = None,
    on_best: Callable[[nn.Module, int, Metrics], None] | None = None,
    checkpoint_dir: str | Path | None = None,
    logger: MetricsLogger | None = None,
    extra_state: SupportsStateDict | None = None,
    distributed: DistributedConfig | None = None,
) -> TrainResult:
    """Train `model` in place for `total_steps(config, plan)` optimizer steps, resuming if possible.

    `collate(indices)` turns a micro-batch of example indices into what `count_units` and `loss_fn` take
    (on the model's device). `evaluate(model, max_batches)` returns validation metrics (prefix their
    names, e.g. "val/accuracy"); it runs every `eval_every` steps on `eval_batches` batches and after the
    last step on everything (`max_batches=None`). `select_best=(metric, "max" | "min")` tracks the best
    value of that validation metric and calls `on_best(model, step, metrics)` whenever it improves.
    `checkpoint_dir=None` disables checkpoints. The logger is not closed: it belongs to the caller.

    In a process started by the `deepspeed` launcher (more than one rank), `distributed` configures
    the DeepSpeed engine and `plan.accumulation_steps` must be a multiple of the world size; after
    `train` returns, ZeRO-3 weights are still partitioned: save them inside
    `distributed.zero.gathered_parameters(model)`.
    """
    context = rank_context()
    init_process_group(context)
    logger = logger if logger is not None and context.is_main else NullLogger()
    checkpoint_root = Path(checkpoint_dir) if checkpoint_dir is not None else None
    total = total_steps(config, plan)
    seed_everything(config.seed)
    update = build_update(model, config, plan, total, distributed, context)
    state = _resume_logged(checkpoint_root, update, extra_state, total, logger, config)
    resumed_from = state.step
    update.model.train()
    show_progress = config.progress_bar and context.is_main and bars_enabled()  # a terminal, not RLHF_QUIET
    with tqdm(total=total, initial=resumed_from, disable=not show_progress, desc="train") as progress:
        for step in range(resumed_from + 1, total + 1):
            micro_batches = _rank_micro_batches(plan, step, collate, context)
            metrics = optimizer_step(update, micro_batches, count_units, loss_fn, step, config)
            metrics["epoch"] = step / plan.steps_per_epoch
            validation = _evaluate_step(update.model, step, total, config, evaluate)
            best_metric = state.best_metric
            if validation is not None:
                metrics.update(validation)
                best_metric = _track_best(update, step, metrics, best_metric, select_best, on_best, context)
            logger.log_metrics(metrics, step)
            state = TrainingState(step=step, best_metric=best_metric, metrics=metrics)
            if checkpoint_root is not None and _checkpoint_due(step, total, config):
                _checkpoint(checkpoint_root, state, update, extra_state, config)
            progress.update(1)
            progress.set_postfix(loss=f"{metrics['loss']:.4f}")
    return TrainResult(
        final_step=state.step, resumed_from=resumed_from, metrics=state.metrics, best_metric=state.best_metric
    )
