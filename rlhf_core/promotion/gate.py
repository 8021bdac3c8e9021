"""The promotion gate: the checks a `challenger` policy must all pass to become the `champion`.

The gate reads the figures of the promotion's evaluation (its metrics.json, rlhf_core/evaluation/report.py)
and of the challenger's PPO run (its metrics.json, logged to MLflow as `final.*`), and holds each to a
bound of `promotion` in params.yaml (null leaves a check out). It is built so that a policy that only
learned to answer shorter cannot pass it (issue 27): a judge that pays for brevity makes the plain win
rate of such a policy high, so the plain rate alone proves nothing.

- `lc_win_rate_low`: the lower end of the 95% interval of the length-controlled win rate (AlpacaEval 2.0:
  the judge's preference with the length difference modelled out) must exceed `min_lc_win_rate_low`
  (0.5: above even). The headline: a win bought with length alone sits at 0.5.
- `win_minus_loss_low`: the lower end of the 95% paired bootstrap interval of win rate minus lose rate
  must exceed `min_win_minus_loss_low`: the challenger wins more often than it loses, beyond chance.
- `length_ratio`: the challenger's mean reply length over the baseline's, at the evaluation's
  `max_new_tokens`, must lie within [`min_length_ratio`, `max_length_ratio`]. The collapse guard holds
  training rollouts to the same band, but those are capped shorter, so a run can pass the guard and still
  answer far shorter at evaluation.
- `alignment_tax_relative`: the challenger's perplexity on held-out chosen replies over the baseline's,
  minus 1, must be at most `max_alignment_tax`: it did not buy its wins with general language ability.
- `differs_from_baseline`: only in the evidence of a challenger whose content is its baseline's
  (rlhf_core/promotion/evidence.py: identical models, not evaluated), and always failed: every pair of such a
  comparison is a tie, which permissive bounds (a negative `min_win_minus_loss_low`) would let pass, and
  a policy the same as its baseline has won nothing.
- `kl_to_reference`: the policy's per-token KL to its reference on held-out prompts (`val/kl_best` of
  its PPO run, the figure the best policy was chosen under) must be at most `max_kl`: it did not win by
  drifting far from the SFT model (paper 5.2).
- `no_collapse`: with `require_no_collapse`, its PPO run had the collapse guard on (`guard_enabled` 1)
  and the guard did not stop it (`guard_stopped` 0). A run without the guard fails, shown as "guard
  disabled", never as no collapse: nothing watched it.

A figure that is missing fails its check, and the check says it is missing and where from (an evaluation
or a PPO run from before the figure existed): evaluate (or train) again.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from pydantic import BaseModel, ConfigDict

from rlhf_core.config import PromotionConfig
from rlhf_core.promotion.evidence import IDENTICAL_MODELS, IDENTICAL_MODELS_FIGURE

# Shown in place of a missing figure, with its name: the evaluation or PPO run predates the figure.
MISSING_FROM_EVALUATION = "missing: {} is not in the evaluation's metrics.json (evaluated before it existed?)"
MISSING_FROM_PPO_RUN = "missing: {} is not in its PPO run's metrics (trained before it was recorded?)"
NO_VALID_VERDICT = "missing: no valid verdict, so no interval"
GUARD_DISABLED = "guard disabled"


class GateCheck(BaseModel):
    """One condition of the gate: the figure, the bound it is held to, and whether it holds. `note` is shown
    in place of the figure when the figure alone would mislead: it is missing (and why), or the collapse
    guard was off (then "not stopped" says nothing about collapse)."""

    model_config = ConfigDict(frozen=True)

    name: str
    value: float | None  # None: the figure is missing, which fails the check
    bound: str
    passed: bool
    note: str | None = None

    def shown_value(self) -> str:
        """The figure (6 significant digits), or the note in its place, or `missing`."""
        if self.note is not None:
            return self.note
        return "missing" if self.value is None else f"{self.value:.6g}"

    def describe(self) -> str:
        """e.g. `win_minus_loss_low = 0.125 (> 0): pass`."""
        return f"{self.name} = {self.shown_value()} ({self.bound}): {'pass' if self.passed else 'FAIL'}"


def figure_check(
    name: str, value: float | None, bound: str, holds: Callable[[float], bool], missing: str
) -> GateCheck:
    """The check of one figure against its bound; a missing figure fails, with `missing` in its place."""
    if value is None:
        return GateCheck(name=name, value=None, bound=bound, passed=False, note=missing)
    return GateCheck(name=name, value=value, bound=bound, passed=holds(value))


def band_bound(low: float | None, high: float | None) -> str | None:
    """The bound text of a band, e.g. `in [0.67, 1.5]`; None when both sides are open (no check)."""
    if low is not None and high is not None:
        return f"in [{low:g}, {high:g}]"
    if low is not None:
        return f">= {low:g}"
    return None if high is None else f"<= {high:g}"


def in_band(value: float, low: float | None, high: float | None) -> bool:
    """low <= value <= high; an open side (None) holds any value."""
    return (low is None or value >= low) and (high is None or value <= high)


def evaluation_checks(settings: PromotionConfig, evaluation: Mapping[str, float]) -> list[GateCheck]:
    """The checks on the evaluation's figures: length-controlled win rate, win minus loss, length ratio,
    alignment tax; and a failed `differs_from_baseline` when the evidence is of identical models."""
    checks = []
    if evaluation.get(IDENTICAL_MODELS_FIGURE) == 1.0:
        bound = "content differs from the baseline's"
        identical = GateCheck(name="differs_from_baseline", value=1.0, bound=bound, passed=False, note=IDENTICAL_MODELS)
        checks.append(identical)
    lc_low = settings.min_lc_win_rate_low
    if lc_low is not None:
        lc_value = evaluation.get("lc_win_rate_low")
        missing = MISSING_FROM_EVALUATION.format("lc_win_rate_low")
        checks.append(figure_check("lc_win_rate_low", lc_value, f"> {lc_low:g}", lambda v: v > lc_low, missing))
    wml_low = settings.min_win_minus_loss_low
    wml_value = evaluation.get("win_minus_loss_low")
    checks.append(
        figure_check("win_minus_loss_low", wml_value, f"> {wml_low:g}", lambda v: v > wml_low, NO_VALID_VERDICT)
    )
    low, high = settings.min_length_ratio, settings.max_length_ratio
    band = band_bound(low, high)
    if band is not None:
        ratio = evaluation.get("length_ratio")
        missing = MISSING_FROM_EVALUATION.format("length_ratio")
        checks.append(figure_check("length_ratio", ratio, band, lambda v: in_band(v, low, high), missing))
    max_tax = settings.max_alignment_tax
    if max_tax is not None:
        tax = evaluation.get("alignment_tax_relative")
        missing = MISSING_FROM_EVALUATION.format("alignment_tax_relative")
        checks.append(figure_check("alignment_tax_relative", tax, f"<= {max_tax:g}", lambda v: v <= max_tax, missing))
    return checks


def collapse_check(training: Mapping[str, float]) -> GateCheck:
    """`no_collapse`: the collapse guard watched the PPO run (`guard_enabled` 1) and did not stop it
    (`guard_stopped` 0). A run without the guard fails, shown as "guard disabled": nothing could have
    stopped it, so its `guard_stopped` 0 says nothing about collapse."""
    enabled, stopped = training.get("guard_enabled"), training.get("guard_stopped")
    note = None
    if enabled is None:
        note = MISSING_FROM_PPO_RUN.format("guard_enabled")
    elif enabled != 1.0:
        note = GUARD_DISABLED
    elif stopped is None:
        note = MISSING_FROM_PPO_RUN.format("guard_stopped")
    passed = note is None and stopped == 0.0
    return GateCheck(
        name="no_collapse", value=stopped, bound="guard_enabled == 1 and guard_stopped == 0", passed=passed, note=note
    )


def gate_checks(
    settings: PromotionConfig, evaluation: Mapping[str, float], training: Mapping[str, float]
) -> list[GateCheck]:
    """Every check of the gate on the evaluation's figures and the PPO run's (see the module docstring);
    a check whose bound is null is left out. The challenger passes when every check passes."""
    checks = evaluation_checks(settings, evaluation)
    max_kl = settings.max_kl
    if max_kl is not None:
        kl = training.get("val/kl_best")
        missing = MISSING_FROM_PPO_RUN.format("val/kl_best")
        checks.append(figure_check("kl_to_reference", kl, f"<= {max_kl:g}", lambda v: v <= max_kl, missing))
    if settings.require_no_collapse:
        checks.append(collapse_check(training))
    return checks
