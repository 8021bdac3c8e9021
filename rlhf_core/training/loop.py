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
"""

import math
import random
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Literal, Protocol, TypeVar

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor, nn
from torch.optim import AdamW, Optimizer
from torch.optim.lr_scheduler import LRScheduler
from tqdm.auto import tqdm

from rlhf_core.training.batching import BatchPlan
from rlhf_core.training.checkpoint import (
    TrainingState,
    checkpoint_step,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from rlhf_core.training.logger import MetricsLogger, NullLogger, RewindableLogger
from rlhf_core.training.precision import autocast
from rlhf_core.training.schedules import ScheduleName, build_scheduler

Batch = TypeVar("Batch")
UnitCounts = dict[str, int]
Metrics = dict[str, float]


class LoopConfig(BaseModel):
    """Everything the loop itself needs; batch shape lives in the `BatchPlan`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    epochs: float = Field(1.0, gt=0, description="Passes over the plan (fractions allowed).")
    max_steps: int | None = Field(None, gt=0, description="Caps the optimizer steps if set.")
    lr: float = Field(gt=0, description="Peak learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW decay; never on biases and norm weights.")
    betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = Field(1e-8, gt=0)
    schedule: ScheduleName = "warmup_cosine"
    warmup_ratio: float = Field(0.0, ge=0, lt=1, description="Share of all steps spent warming up.")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="End of the cosine, as a share of lr.")
    max_grad_norm: float | None = Field(1.0, gt=0, description="Global norm clipping; None is off.")
    checkpoint_every: int | None = Field(None, ge=1, description="None: only the final checkpoint.")
    keep_checkpoints: int | None = Field(2, ge=1, description="Newest checkpoints kept; None keeps all.")
    eval_every: int | None = Field(None, ge=1, description="Steps between periodic validations.")
    eval_batches: int | None = Field(None, ge=1, description="Batches per periodic validation.")
    seed: int = 0
    bf16: bool = Field(False, description="bf16 autocast on CUDA; ignored on CPU.")
    progress_bar: bool = True


class SupportsStateDict(Protocol):
    """Extra state the caller wants checkpointed with the loop (e.g. running reward statistics)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class NonFiniteLossError(RuntimeError):
    """A loss or the gradient norm was NaN or inf; raised before the optimizer stepped (weights intact)."""

    def __init__(self, step: int, value: float, quantity: str) -> None:
        super().__init__(
            f"{quantity} is {value} at optimizer step {step}; stopped before the optimizer step, so the "
            "weights and the checkpoints are untouched"
        )
        self.step = step
        self.value = value


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
    trainable = [p for p in model.parameters() if p.requires_grad]
    if not trainable:
        raise ValueError("the model has no trainable parameters (all have requires_grad=False)")
    groups = [
        {"params": [p for p in trainable if p.ndim >= 2], "weight_decay": config.weight_decay},
        {"params": [p for p in trainable if p.ndim < 2], "weight_decay": 0.0},
    ]
    return AdamW([g for g in groups if g["params"]], lr=config.lr, betas=config.betas, eps=config.adam_eps)


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
    model: nn.Module,
    optimizer: Optimizer,
    scheduler: LRScheduler,
    micro_batches: list[Batch],
    count_units: Callable[[Batch], UnitCounts],
    loss_fn: Callable[[nn.Module, Batch, UnitCounts], tuple[Tensor, Metrics]],
    step: int,
    config: LoopConfig,
) -> Metrics:
    """One accumulated update: backward every micro-batch against the step's totals, clip, step, zero."""
    totals = sum_unit_counts([count_units(batch) for batch in micro_batches])
    device = next(model.parameters()).device
    metrics: Metrics = {}
    loss_sum = 0.0
    for index, batch in enumerate(micro_batches):
        with autocast(device, config.bf16):
            loss, batch_metrics = loss_fn(model, batch, totals)
        value = loss.item()
        if not math.isfinite(value):
            optimizer.zero_grad(set_to_none=True)
            raise NonFiniteLossError(step, value, f"the loss of micro-batch {index}")
        loss.backward()
        loss_sum += value
        for name, metric in batch_metrics.items():
            metrics[name] = metrics.get(name, 0.0) + float(metric)
    trainable = [p for p in model.parameters() if p.requires_grad]
    # With clipping off, an infinite threshold still returns the norm and leaves the gradients as they are.
    max_norm = config.max_grad_norm if config.max_grad_norm is not None else math.inf
    grad_norm = torch.nn.utils.clip_grad_norm_(trainable, max_norm).item()
    if not math.isfinite(grad_norm):  # a finite loss can still overflow in backward (e.g. in bf16)
        optimizer.zero_grad(set_to_none=True)
        raise NonFiniteLossError(step, grad_norm, "the gradient norm")
    lr = scheduler.get_last_lr()[0]
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return {**metrics, "loss": loss_sum, "grad_norm": grad_norm, "lr": lr}


def run_evaluation(
    model: nn.Module,
    evaluate: Callable[[nn.Module, int | None], Metrics],
    max_batches: int | None,
    bf16: bool,
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
    checkpoint_dir: Path | None,
    model: nn.Module,
    optimizer: Optimizer,
    scheduler: LRScheduler,
    extra_state: SupportsStateDict | None,
    total: int,
) -> TrainingState:
    """Restore the newest complete checkpoint in place, or return the state of a fresh start (step 0)."""
    latest = latest_checkpoint(checkpoint_dir) if checkpoint_dir is not None else None
    if latest is None:
        return TrainingState(step=0)
    if checkpoint_step(latest) > total:
        raise ValueError(f"checkpoint {latest} is past the end of training ({total} steps)")
    state = load_checkpoint(latest, model, optimizer, scheduler)
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
    model: nn.Module,
    step: int,
    metrics: Metrics,
    best: float | None,
    select_best: tuple[str, Literal["max", "min"]] | None,
    on_best: Callable[[nn.Module, int, Metrics], None] | None,
) -> float | None:
    """The best value of the selected metric after this validation; calls `on_best` when it improved."""
    if select_best is None:
        return best
    name, mode = select_best
    if name not in metrics:
        raise KeyError(f"select_best metric {name!r} is not among the metrics {sorted(metrics)}")
    if not is_improvement(metrics[name], best, mode):
        return best
    if on_best is not None:
        on_best(model, step, metrics)
    return metrics[name]


def _checkpoint_due(step: int, total: int, config: LoopConfig) -> bool:
    """Every `checkpoint_every` steps, and always after the last step (so a rerun finds the run finished)."""
    every = config.checkpoint_every
    return step == total or (every is not None and step % every == 0)


def _checkpoint(
    root: Path,
    state: TrainingState,
    model: nn.Module,
    optimizer: Optimizer,
    scheduler: LRScheduler,
    extra_state: SupportsStateDict | None,
    config: LoopConfig,
) -> None:
    """Save `state` plus the caller's extra state, keeping the newest `keep_checkpoints`."""
    extra = extra_state.state_dict() if extra_state is not None else {}
    save_checkpoint(root, replace(state, extra=extra), model, optimizer, scheduler, config.keep_checkpoints)


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
) -> TrainResult:
    """Train `model` in place for `total_steps(config, plan)` optimizer steps, resuming if possible.

    `collate(indices)` turns a micro-batch of example indices into what `count_units` and `loss_fn` take
    (on the model's device). `evaluate(model, max_batches)` returns validation metrics (prefix their
    names, e.g. "val/accuracy"); it runs every `eval_every` steps on `eval_batches` batches and after the
    last step on everything (`max_batches=None`). `select_best=(metric, "max" | "min")` tracks the best
    value of that validation metric and calls `on_best(model, step, metrics)` whenever it improves.
    `checkpoint_dir=None` disables checkpoints. The logger is not closed: it belongs to the caller.
    """
    logger = logger if logger is not None else NullLogger()
    checkpoint_root = Path(checkpoint_dir) if checkpoint_dir is not None else None
    total = total_steps(config, plan)
    seed_everything(config.seed)
    optimizer = build_optimizer(model, config)
    scheduler = build_scheduler(optimizer, config.schedule, total, config.warmup_ratio, config.min_lr_ratio)
    state = resume(checkpoint_root, model, optimizer, scheduler, extra_state, total)
    resumed_from = state.step
    if isinstance(logger, RewindableLogger):
        logger.truncate_after(resumed_from)
    logger.log_params({"loop": config.model_dump(mode="json"), "total_steps": total})
    model.train()
    with tqdm(total=total, initial=resumed_from, disable=not config.progress_bar, desc="train") as progress:
        for step in range(resumed_from + 1, total + 1):
            micro_batches = [collate(indices) for indices in plan.step(step - 1)]
            metrics = optimizer_step(
                model, optimizer, scheduler, micro_batches, count_units, loss_fn, step, config
            )
            metrics["epoch"] = step / plan.steps_per_epoch
            validation = _evaluate_step(model, step, total, config, evaluate)
            best_metric = state.best_metric
            if validation is not None:
                metrics.update(validation)
                best_metric = _track_best(model, step, metrics, best_metric, select_best, on_best)
            logger.log_metrics(metrics, step)
            state = TrainingState(step=step, best_metric=best_metric, metrics=metrics)
            if checkpoint_root is not None and _checkpoint_due(step, total, config):
                _checkpoint(checkpoint_root, state, model, optimizer, scheduler, extra_state, config)
            progress.update(1)
            progress.set_postfix(loss=f"{metrics['loss']:.4f}")
    return TrainResult(
        final_step=state.step, resumed_from=resumed_from, metrics=state.metrics, best_metric=state.best_metric
    )
