"""How the loop applies an optimizer step: in this process, or through a DeepSpeed engine across ranks.

The loop (loop.py) only talks to a `ModelUpdate`: it runs forward passes on `update.model`, hands every
micro-batch's loss to `backward`, and calls `step` once per optimizer step. Two implementations:

* `LocalUpdate` (here): the single-process default. AdamW and the lr schedule over the trainable
  parameters; `step` clips the global gradient norm and raises `NonFiniteLossError` BEFORE the optimizer
  steps when that norm is NaN or inf.
* `DeepSpeedUpdate` (rlhf_core/training/deepspeed_update.py): one rank of a multi-process run; a DeepSpeed ZeRO
  engine averages the gradients across ranks, clips and steps.

Both checkpoint through the same atomic layout (checkpoint.py), so resuming works the same way.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor, nn
from torch.optim import AdamW

from rlhf_core.training.checkpoint import TrainingState, load_checkpoint, save_checkpoint
from rlhf_core.training.schedules import ScheduleName, build_scheduler

FUSED_ADAMW_DEVICES = ("cpu", "cuda")


class NonFiniteLossError(RuntimeError):
    """A loss or the gradient norm was NaN or inf; raised before the optimizer stepped (weights intact)."""

    def __init__(self, step: int, value: float, quantity: str) -> None:
        super().__init__(
            f"{quantity} is {value} at optimizer step {step}; stopped before the optimizer step, so the "
            "weights and the checkpoints are untouched"
        )
        self.step = step
        self.value = value


class ModelUpdate(Protocol):
    """What the loop needs to turn micro-batch losses into optimizer steps and checkpoints."""

    @property
    def model(self) -> nn.Module:
        """The module forward passes run on (the engine's module under DeepSpeed)."""
        ...

    def lr(self) -> float:
        """The learning rate the next optimizer step applies."""
        ...

    def backward(self, loss: Tensor) -> None:
        """Accumulate the gradient of one micro-batch's loss (already normalised by the step's totals)."""
        ...

    def discard_gradients(self) -> None:
        """Drop accumulated gradients (a non-finite loss ends the step before it is applied)."""
        ...

    def step(self, step: int) -> float:
        """Apply the accumulated update; returns the gradient norm before clipping."""
        ...

    def save(self, root: Path, state: TrainingState, keep: int | None) -> None:
        """Checkpoint weights, optimizer, scheduler and RNG with the loop's `state` under `root`."""
        ...

    def restore(self, path: Path) -> TrainingState:
        """Load the checkpoint at `path` in place; returns the loop's state saved with it."""
        ...


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """The trainable parameters in AdamW groups: matrices decay, 1-d tensors (biases, norms) do not."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    if not trainable:
        raise ValueError("the model has no trainable parameters (all have requires_grad=False)")
    groups = [
        {"params": [p for p in trainable if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in trainable if p.ndim < 2], "weight_decay": 0.0},
    ]
    return [group for group in groups if group["params"]]


def adamw(groups: list[dict[str, Any]], **hyperparameters: Any) -> AdamW:
    """torch's AdamW, with its fused kernel where every parameter allows it (floating point, CPU or CUDA).

    The fused kernel makes one pass over each parameter and its two moments; the default on CPU is a
    loop of about ten elementwise ops per tensor. Same update up to float rounding (2e-7 over 50 steps),
    about 9x faster on this project's CPU (docs/rollout-engine.md, "Training"). A checkpoint saved by
    either kind resumes with the kind it was saved with (the saved parameter groups carry the flag).
    """
    parameters = [p for group in groups for p in group["params"]]
    fused = all(p.is_floating_point() and p.device.type in FUSED_ADAMW_DEVICES for p in parameters)
    return AdamW(groups, fused=fused, **hyperparameters)


def build_adamw(model: nn.Module, lr: float, weight_decay: float, betas: tuple[float, float], eps: float) -> AdamW:
    """AdamW over `parameter_groups(model, weight_decay)`."""
    return adamw(parameter_groups(model, weight_decay), lr=lr, betas=betas, eps=eps)


class LocalUpdate:
    """The single-process update: AdamW + lr schedule; global-norm clipping; checked before stepping."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: AdamW,
        schedule: ScheduleName,
        total_steps: int,
        warmup_ratio: float,
        min_lr_ratio: float,
        max_grad_norm: float | None,
    ) -> None:
        self._model = model
        self.optimizer = optimizer
        self.scheduler = build_scheduler(optimizer, schedule, total_steps, warmup_ratio, min_lr_ratio)
        self.max_grad_norm = max_grad_norm

    @property
    def model(self) -> nn.Module:
        return self._model

    def lr(self) -> float:
        return self.scheduler.get_last_lr()[0]

    def backward(self, loss: Tensor) -> None:
        loss.backward()

    def discard_gradients(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def step(self, step: int) -> float:
        """Clip to `max_grad_norm` (the norm is returned either way), check it, step, zero the gradients."""
        trainable = [p for p in self._model.parameters() if p.requires_grad]
        # With clipping off, an infinite threshold still returns the norm and leaves the gradients alone.
        max_norm = self.max_grad_norm if self.max_grad_norm is not None else math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(trainable, max_norm).item()
        if not math.isfinite(grad_norm):  # a finite loss can still overflow in backward (e.g. in bf16)
            self.discard_gradients()
            raise NonFiniteLossError(step, grad_norm, "the gradient norm")
        self.optimizer.step()
        self.scheduler.step()
        self.discard_gradients()
        return grad_norm

    def save(self, root: Path, state: TrainingState, keep: int | None) -> None:
        save_checkpoint(root, state, self._model, self.optimizer, self.scheduler, keep)

    def restore(self, path: Path) -> TrainingState:
        return load_checkpoint(path, self._model, self.optimizer, self.scheduler)
