"""Learning-rate schedules as pure functions of the optimizer step, returning a multiplier of the peak lr.

`step` is the 0-based index of the optimizer update, which is exactly what `torch.optim.lr_scheduler.LambdaLR`
passes to its function: update 0 runs at `peak * schedule(0)`, update k at `peak * schedule(k)`.
Warmup starts at `1 / warmup_steps` rather than 0, so the first update is never wasted at lr = 0.
"""

import math
from typing import Literal

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

ScheduleName = Literal["warmup_cosine", "warmup_constant"]


def _warmup(step: int, warmup_steps: int) -> float:
    """Linear ramp 1/w, 2/w, ..., 1 over the first `warmup_steps` updates, then 1."""
    if step >= warmup_steps:
        return 1.0
    return (step + 1) / warmup_steps


def warmup_cosine(step: int, total: int, warmup_steps: int, min_ratio: float) -> float:
    """SFT schedule (paper 5.1): linear warmup, then cosine decay from 1 to `min_ratio` at the last update.

    The cosine covers updates `warmup_steps .. total - 1`: the first of them runs at 1, the last one
    (`total - 1`) at exactly `min_ratio`, and any step past the end stays there. With at most one update
    after warmup there is nothing to decay over, and it runs at 1.
    """
    if step < warmup_steps:
        return _warmup(step, warmup_steps)
    decay_steps = total - 1 - warmup_steps
    if decay_steps <= 0:
        return 1.0
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def warmup_constant(step: int, warmup_steps: int) -> float:
    """Reward-model schedule (paper 4.2): linear warmup (the first 10% of steps there), then constant."""
    return _warmup(step, warmup_steps)


def build_scheduler(
    optimizer: Optimizer, name: ScheduleName, total_steps: int, warmup_ratio: float, min_ratio: float
) -> LambdaLR:
    """Wrap the named schedule in a `LambdaLR`; warmup lasts `round(warmup_ratio * total_steps)` updates.

    The lambda is a plain closure, so the scheduler's `state_dict()` holds only its counters and a
    resumed run rebuilds the same function from the same arguments.
    """
    warmup_steps = round(warmup_ratio * total_steps)
    if name == "warmup_cosine":
        return LambdaLR(optimizer, lambda step: warmup_cosine(step, total_steps, warmup_steps, min_ratio))
    if name == "warmup_constant":
        return LambdaLR(optimizer, lambda step: warmup_constant(step, warmup_steps))
    raise ValueError(f"unknown schedule {name!r}; expected 'warmup_cosine' or 'warmup_constant'")
