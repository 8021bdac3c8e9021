"""Which validated policy a PPO run hands on (paper 5.2: reward alone misleads; docs/stages-ppo.md).

Every validation samples one response per held-out prompt with the same prompts and the same
per-batch seeds, so two validations differ only by the policy and their per-prompt rewards can be
compared PAIRED: the difference ``d_i = r_a,i - r_b,i`` removes the prompt-to-prompt spread, which is
most of the variance of a mean reward over a few dozen prompts.

The rule (`select_policy`): among the validations within the KL bound, take the LATEST, unless an
earlier one beats it by more than `margin_se` paired standard errors; then the earlier one that beats
it by the most. A strict "highest mean reward" rule would keep the start whenever noise happens to
favour it (about a third of the time when nothing changed); this rule needs evidence to go back.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

Z_95 = 1.959963984540054  # two-sided 95% quantile of the standard normal


@dataclass(frozen=True)
class ValidationRecord:
    """One validation: its iteration (0: the initial policy), per-token KL and one reward per prompt."""

    step: int
    kl: float
    rewards: tuple[float, ...]

    def to_dict(self) -> dict[str, object]:
        return {"step": self.step, "kl": self.kl, "rewards": list(self.rewards)}

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> ValidationRecord:
        return cls(step=int(data["step"]), kl=float(data["kl"]), rewards=tuple(float(r) for r in data["rewards"]))


@dataclass(frozen=True)
class PairedDifference:
    """Mean of the per-prompt differences a - b, its standard error and 95% normal interval."""

    mean: float
    standard_error: float
    low: float
    high: float
    prompts: int


def paired_difference(a: Sequence[float], b: Sequence[float]) -> PairedDifference:
    """Paired mean difference ``mean(a_i - b_i)`` with ``SE = sd(d) / sqrt(n)`` (n - 1 in the sd)."""
    if len(a) != len(b) or not a:
        raise ValueError(f"paired rewards need equal, non-zero lengths; got {len(a)} and {len(b)}")
    differences = [x - y for x, y in zip(a, b)]
    n = len(differences)
    mean = sum(differences) / n
    variance = sum((d - mean) ** 2 for d in differences) / (n - 1) if n > 1 else 0.0
    se = math.sqrt(variance / n)
    return PairedDifference(mean=mean, standard_error=se, low=mean - Z_95 * se, high=mean + Z_95 * se, prompts=n)


@dataclass(frozen=True)
class Selection:
    """The chosen validation, why, and how it compares with the initial policy (step 0)."""

    step: int
    reason: str
    versus_initial: PairedDifference


def select_policy(records: Sequence[ValidationRecord], max_kl: float | None, margin_se: float = 2.0) -> Selection:
    """The rule of the module docstring. `records` in step order, the first one the initial policy."""
    if not records or records[0].step != 0:
        raise ValueError("selection needs the initial policy's validation (step 0) first")
    within = [record for record in records if max_kl is None or record.kl <= max_kl]
    initial = records[0]
    if not within:
        raise ValueError("no validated policy within the KL bound, not even the initial one")
    latest = within[-1]
    best, best_gain = latest, 0.0
    for earlier in within[:-1]:
        gain = paired_difference(earlier.rewards, latest.rewards)
        if gain.mean > margin_se * gain.standard_error and gain.mean > best_gain:
            best, best_gain = earlier, gain.mean
    if best is latest:
        reason = (
            f"latest policy within the KL bound (step {latest.step}): no earlier one beats it by more than "
            f"{margin_se:g} paired standard errors"
        )
    else:
        reason = (
            f"step {best.step} beats the latest policy within the KL bound (step {latest.step}) by "
            f"{best_gain:.4g} reward, more than {margin_se:g} paired standard errors"
        )
    return Selection(step=best.step, reason=reason, versus_initial=paired_difference(best.rewards, initial.rewards))
