"""Mixed precision: which of bf16 and fp32 a stage computes in, and the context that applies it.

`distributed.bf16` is `auto`, `on` or `off`; `choose_precision` turns it into a `PrecisionChoice` for the
device a stage runs on, with the reason in words (logged by the stage):

- `off`: float32 everywhere, bit for bit the path of a CPU without bf16 units.
- `on`: bf16, whatever the device (on a CPU without native bf16 units torch emulates it, far slower).
- `auto`: bf16 on a CUDA device that supports it; on a CPU only where its bf16 matrix product is measurably
  faster than float32's (rlhf_core/bf16_probe.py: the units, then a timed matmul at the model's shapes).

bf16 means autocast: weights, gradients and optimizer states stay float32 (the master copies); the matrix
products of forward and backward run in bf16. bf16 keeps float32's exponent range, so no loss scaling is
needed. What precision decides stays float32 under it, by the code that computes it rather than by this
module: log-probabilities, the PPO ratio and KL, advantages and value targets are computed from logits and
values upcast to float32 (ppo/losses.py `at_least_float32`), and losses are reduced in float32. How each
stage uses it: docs/scale-out.md, "Precision".
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Literal

import torch

from rlhf_core.bf16_probe import MatmulRates

PrecisionSetting = Literal["auto", "on", "off"]
# bf16 must beat float32's matrix product by this much on a CPU before `auto` takes it: autocast casts
# activations and frozen weights at every product, which a smaller gain would not repay.
MIN_CPU_SPEEDUP = 1.25


@dataclass(frozen=True)
class PrecisionChoice:
    """Whether a stage computes in bf16, and why (one line for the log and the run's record)."""

    bf16: bool
    reason: str


def choose_precision(
    setting: PrecisionSetting, device: torch.device, cpu_rates: Callable[[], MatmulRates]
) -> PrecisionChoice:
    """`setting` for `device`; `cpu_rates` is called only when `auto` must measure a CPU."""
    if setting == "off":
        return PrecisionChoice(False, "distributed.bf16 = off: float32")
    if setting == "on":
        return PrecisionChoice(True, "distributed.bf16 = on: bf16 autocast")
    if device.type == "cuda":
        supported = torch.cuda.is_bf16_supported()
        return PrecisionChoice(supported, f"auto: {'bf16' if supported else 'float32'} (this GPU's bf16 support)")
    return _choose_on_cpu(cpu_rates())


def _choose_on_cpu(rates: MatmulRates) -> PrecisionChoice:
    """`auto` on a CPU: bf16 where it has the units and its bf16 products are at least MIN_CPU_SPEEDUP faster."""
    if not rates.native_bf16:
        return PrecisionChoice(False, "auto: float32 (this CPU has no native bf16 units; torch would emulate them)")
    measured = (
        f"bf16 matmul {rates.speedup:.2f}x float32's here: {rates.bfloat16_gflops:.0f} vs "
        f"{rates.float32_gflops:.0f} GFLOP/s on one thread"
    )
    if rates.speedup >= MIN_CPU_SPEEDUP:
        return PrecisionChoice(True, f"auto: bf16 ({measured})")
    return PrecisionChoice(False, f"auto: float32 ({measured}, under the {MIN_CPU_SPEEDUP}x that pays for the casts)")


def autocast(device: torch.device, bf16: bool) -> AbstractContextManager[object]:
    """The context to run forward passes (and so their backward) in: bf16 autocast if `bf16`, else a no-op."""
    if bf16:
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()
