"""The collapse guard: stop a PPO run as soon as a monitor leaves its safe range (paper section 5.2).

The paper finds that a collapsing run announces itself in cheap signals long before a human would
notice: the KL to the reference climbs, responses grow or shrink, their perplexity drops (the
policy becomes over-confident, repeating a pattern the reward model likes). The guard checks each
rollout's monitors against configured bounds; length and perplexity are judged RELATIVE TO THE
START of the run (the mean over the rollouts of the initial, SFT policy), KL is absolute. The length is
the mean over the latest `length_window` rollouts (1: this rollout alone), since one rollout's few
replies vary in length by themselves. A NaN or infinite
loss or gradient norm stops the run too, before the optimizer applies it.

The length band (`min_length_ratio`, `max_length_ratio`) defaults to the promotion gate's band on the
evaluation's length ratio (tasks/promotion/promote_tasks.py): a run that learns mostly to answer shorter stops here, on
its training rollouts, rather than hand on a policy the gate would refuse. The gate checks the length
again at evaluation's `max_new_tokens`, since training rollouts are capped shorter (ppo.rollout).

Crossing a bound raises `CollapseError`, whose message names the bound, the value, the limit and the
step. The trainer's caller then hands on the best checkpoint (see `trainer.fit`), not the last one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from rlhf_core.config import CollapseGuardConfig

KL_METRIC = "kl/token_k3"
LENGTH_METRIC = "response/length_mean"
PERPLEXITY_METRIC = "perplexity/policy"


class CollapseError(RuntimeError):
    """A guard bound was crossed at `step`; `bound` names it ("max_kl", ..., or "finite")."""

    def __init__(self, bound: str, step: int, detail: str) -> None:
        super().__init__(f"collapse guard stopped the run at step {step}: {detail} [bound: {bound}]")
        self.bound = bound
        self.step = step


def check_finite(name: str, value: float, step: int) -> None:
    """Raise `CollapseError` ("finite") when a loss, gradient norm or guarded monitor is NaN or inf."""
    if not math.isfinite(value):
        raise CollapseError("finite", step, f"{name} is {value}; nothing of this step was applied")


def check_kl(kl: float, max_kl: float | None, step: int) -> None:
    """Per-token KL to the reference must stay at or below `max_kl` (None: no bound)."""
    if max_kl is not None and kl > max_kl:
        raise CollapseError("max_kl", step, f"per-token KL to the reference {kl:.4g} > max_kl {max_kl:g}")


def check_length_ratio(
    length: float, start_length: float, min_ratio: float | None, max_ratio: float | None, step: int, rollouts: int = 1
) -> None:
    """Mean response length over the initial policy's must stay within [`min_ratio`, `max_ratio`] (None:
    that side open): the band the promotion gate holds the evaluation replies to, so a run that learns to
    answer shorter stops before it hands on a policy the gate would refuse. `rollouts` is how many of the
    latest rollouts `length` averages, named in the message so a stop is read against the right window."""
    ratio = length / start_length
    window = f" over the latest {rollouts} rollouts" if rollouts > 1 else ""
    detail = f"mean response length{window} {length:.4g} is {ratio:.3g} times the initial policy's {start_length:.4g}"
    if min_ratio is not None and ratio < min_ratio:
        raise CollapseError("min_length_ratio", step, f"{detail}, below min_length_ratio {min_ratio:g}")
    if max_ratio is not None and ratio > max_ratio:
        raise CollapseError("max_length_ratio", step, f"{detail}, above max_length_ratio {max_ratio:g}")


def check_perplexity_drop(perplexity: float, start_perplexity: float, max_drop: float | None, step: int) -> None:
    """Response perplexity must not fall by more than the share `max_drop` of the initial policy's."""
    if max_drop is None:
        return
    drop = 1.0 - perplexity / start_perplexity
    if drop > max_drop:
        raise CollapseError(
            "max_perplexity_drop",
            step,
            f"response perplexity {perplexity:.4g} is {drop:.1%} below the initial policy's "
            f"{start_perplexity:.4g} (max_perplexity_drop {max_drop:g})",
        )


@dataclass
class CollapseGuard:
    """The bounds plus the run's starting point; checkpointed so a resumed run keeps its baseline.

    The starting point is the mean length and perplexity over every rollout the initial (SFT) policy
    makes: the critic-pretraining iterations and the first PPO iteration (whose rollout precedes the
    policy's first update). A single rollout of a few responses is a noisy reference.
    """

    bounds: CollapseGuardConfig
    baseline_rollouts: int = 0
    start_length: float = 0.0
    start_perplexity: float = 0.0
    recent_lengths: list[float] = field(default_factory=list)  # the latest `length_window` rollouts' means

    def check(self, metrics: dict[str, float], step: int, initial_policy: bool) -> None:
        """Check one rollout's monitors; rollouts of the `initial_policy` also extend the baseline."""
        for name in (KL_METRIC, LENGTH_METRIC, PERPLEXITY_METRIC):
            check_finite(name, metrics[name], step)
        if initial_policy:
            self._extend_baseline(metrics[LENGTH_METRIC], metrics[PERPLEXITY_METRIC])
        self.recent_lengths = [*self.recent_lengths, metrics[LENGTH_METRIC]][-self.bounds.length_window :]
        if self.baseline_rollouts == 0:
            raise ValueError("the guard's baseline is empty: the first rollout must come from the initial policy")
        check_kl(metrics[KL_METRIC], self.bounds.max_kl, step)
        check_length_ratio(
            sum(self.recent_lengths) / len(self.recent_lengths),
            self.start_length,
            self.bounds.min_length_ratio,
            self.bounds.max_length_ratio,
            step,
            rollouts=len(self.recent_lengths),
        )
        check_perplexity_drop(metrics[PERPLEXITY_METRIC], self.start_perplexity, self.bounds.max_perplexity_drop, step)

    def _extend_baseline(self, length: float, perplexity: float) -> None:
        """Running means over the initial policy's rollouts."""
        self.baseline_rollouts += 1
        self.start_length += (length - self.start_length) / self.baseline_rollouts
        self.start_perplexity += (perplexity - self.start_perplexity) / self.baseline_rollouts

    def within_kl_bound(self, kl: float) -> bool:
        """Whether a policy with this per-token KL may be handed on as the best checkpoint."""
        return self.bounds.max_kl is None or kl <= self.bounds.max_kl

    def state_dict(self) -> dict[str, float | list[float]]:
        return {
            "baseline_rollouts": self.baseline_rollouts,
            "start_length": self.start_length,
            "start_perplexity": self.start_perplexity,
            "recent_lengths": list(self.recent_lengths),
        }

    def load_state_dict(self, state: dict[str, float | list[float]]) -> None:
        self.baseline_rollouts = int(state["baseline_rollouts"])
        self.start_length = float(state["start_length"])
        self.start_perplexity = float(state["start_perplexity"])
        self.recent_lengths = [float(length) for length in state.get("recent_lengths", [])]  # absent: older checkpoints
