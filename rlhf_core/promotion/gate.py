"""The promotion gate: the checks a `challenger` policy must all pass to become the `champion`.

The gate reads the figures of the promotion's evaluation (its metrics.json, rlhf_core/evaluation/report.py)
and of the challenger's PPO run (its metrics.json, logged to MLflow as `final.*`), and holds each to a
bound of `promotion` in params.yaml (null leaves a check out). It is built so that a policy that only
learned to answer shorter cannot pass it: a judge that pays for brevity makes the plain win
rate of such a policy high, so the plain rate alone proves nothing.

- `lc_win_rate_low`: the lower end of the 95% interval of the length-controlled win rate (AlpacaEval 2.0:
  the judge's preference with the length difference modelled out, the judge's length preference pinned
  by anchor pairs of the baseline against itself) must exceed `min_lc_win_rate_low` (0.5: above even).
  The headline: a win bought with length alone sits at 0.5. When the evaluation could not separate
  quality from length (`lc_identifiable` 0: too few anchor pairs as far apart as the compared pairs) the
  check fails, shown as "not identifiable", never as a number; an evaluation from before anchor rows
  (no `lc_identifiable`) fails as missing it.
- `win_minus_loss_low`: the lower end of the 95% paired bootstrap interval of win rate minus lose rate
  must exceed `min_win_minus_loss_low`: the challenger wins more often than it loses, beyond chance.
- `length_ratio`: the challenger's mean reply length over the baseline's, at the evaluation's
  `max_new_tokens`, must lie within [`min_length_ratio`, `max_length_ratio`]. The collapse guard holds
  training rollouts to the same band, but those are capped shorter, so a run can pass the guard and still
  answer far shorter at evaluation.
- `alignment_tax_relative`: the challenger's perplexity on held-out chosen replies over the baseline's,
  minus 1, must be at most `max_alignment_tax`: it did not buy its wins with general language ability.
- `length_ratio_vs_sft`, `alignment_tax_relative_vs_sft`: while the baseline is a champion, the same two
  bounds against the SFT model the challenger's lineage starts from (the figures of the pipeline run's
  evaluation of the challenger against it, tagged on the registered version as `evaluation.*`), so no
  chain of promotions drifts further from SFT than one promotion may: each may shorten by a third on
  top of the last otherwise. Against the SFT model itself (no champion yet) the first two are these.
- `differs_from_baseline`: only in the evidence of a challenger whose content is its baseline's
  (rlhf_core/promotion/evidence.py: identical models, not evaluated), and always failed: every pair of such a
  comparison is a tie, which permissive bounds (a negative `min_win_minus_loss_low`) would let pass, and
  a policy the same as its baseline has won nothing.
- `kl_to_reference`: the policy's per-token KL to its reference on held-out prompts (`val/kl_best` of
  its PPO run, the figure the best policy was chosen under) must be at most `max_kl`: it did not win by
  drifting far from the SFT model (paper 5.2).
- `no_collapse`: with `require_no_collapse`, its PPO run had the collapse guard on with its length band
  and its KL bound set (`guard_enabled`, `guard_length_band`, `guard_kl_bound` 1) and the guard did not
  stop it (`guard_stopped` 0). A run without the guard fails, shown as "guard disabled", never as no
  collapse: nothing watched it; a run with a bound off fails, shown as e.g. "length band off". With
  `require_no_collapse` false the check is still listed, passed and shown as not required, so the
  decision records that the gate was told not to look.

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
SFT_SUFFIX = "_vs_sft"  # the checks held to the SFT model of the challenger's lineage
MISSING_AGAINST_SFT = (
    "missing: the challenger has no evaluation.{} tag (its pipeline run's evaluation against its SFT model)"
)
NO_VALID_VERDICT = "missing: no valid verdict, so no interval"
GUARD_DISABLED = "guard disabled"
# The bounds of the collapse guard `no_collapse` needs on (metrics.json of the PPO run, stages/ppo.py).
REQUIRED_GUARD_BOUNDS = {"guard_length_band": "length band", "guard_kl_bound": "KL bound"}
NOT_REQUIRED = "not required (promotion.require_no_collapse: false)"
NO_COLLAPSE_BOUND = "guard on with length band and KL bound, guard_stopped == 0"
NOT_IDENTIFIABLE = (
    "not identifiable: the verdicts cannot separate quality from length (the evaluation's report says why)"
)


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


def figure_check(name: str, value: float | None, bound: str, holds: Callable[[float], bool], missing: str) -> GateCheck:
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


def length_controlled_check(lc_low: float, evaluation: Mapping[str, float]) -> GateCheck:
    """`lc_win_rate_low` above `lc_low`, when the evaluation identified it (`lc_identifiable` 1); an
    unidentified rate fails as not identifiable, an evaluation without the figure as missing it."""
    bound = f"> {lc_low:g}"
    identifiable = evaluation.get("lc_identifiable")
    if identifiable is None:
        missing = MISSING_FROM_EVALUATION.format("lc_identifiable")
        return GateCheck(name="lc_win_rate_low", value=None, bound=bound, passed=False, note=missing)
    if identifiable != 1.0:
        return GateCheck(name="lc_win_rate_low", value=None, bound=bound, passed=False, note=NOT_IDENTIFIABLE)
    missing = MISSING_FROM_EVALUATION.format("lc_win_rate_low")
    return figure_check("lc_win_rate_low", evaluation.get("lc_win_rate_low"), bound, lambda v: v > lc_low, missing)


def evaluation_checks(settings: PromotionConfig, evaluation: Mapping[str, float]) -> list[GateCheck]:
    """The checks on the evaluation's figures: length-controlled win rate, win minus loss, length ratio,
    alignment tax; and a failed `differs_from_baseline` when the evidence is of identical models."""
    checks = []
    if evaluation.get(IDENTICAL_MODELS_FIGURE) == 1.0:
        bound = "content differs from the baseline's"
        identical = GateCheck(name="differs_from_baseline", value=1.0, bound=bound, passed=False, note=IDENTICAL_MODELS)
        checks.append(identical)
    if settings.min_lc_win_rate_low is not None:
        checks.append(length_controlled_check(settings.min_lc_win_rate_low, evaluation))
    wml_low = settings.min_win_minus_loss_low
    wml_value = evaluation.get("win_minus_loss_low")
    checks.append(
        figure_check("win_minus_loss_low", wml_value, f"> {wml_low:g}", lambda v: v > wml_low, NO_VALID_VERDICT)
    )
    return checks + drift_checks(settings, evaluation, MISSING_FROM_EVALUATION, "")


def drift_checks(settings: PromotionConfig, figures: Mapping[str, float], missing: str, suffix: str) -> list[GateCheck]:
    """The length band on `length_ratio` and the alignment tax bound on `alignment_tax_relative` of
    `figures`, the checks named with `suffix` (`_vs_sft`: the challenger's figures against the SFT model of
    its lineage); `missing` (with the figure's name) in place of one that is not there."""
    checks = []
    low, high = settings.min_length_ratio, settings.max_length_ratio
    band = band_bound(low, high)
    if band is not None:
        ratio, note = figures.get("length_ratio"), missing.format("length_ratio")
        checks.append(figure_check(f"length_ratio{suffix}", ratio, band, lambda v: in_band(v, low, high), note))
    max_tax = settings.max_alignment_tax
    if max_tax is not None:
        tax, note = figures.get("alignment_tax_relative"), missing.format("alignment_tax_relative")
        bound = f"<= {max_tax:g}"
        checks.append(figure_check(f"alignment_tax_relative{suffix}", tax, bound, lambda v: v <= max_tax, note))
    return checks


def collapse_note(training: Mapping[str, float]) -> str | None:
    """Why the PPO run's `guard_stopped` 0 would say nothing about collapse (None: it says it): a figure
    missing, the guard disabled, or a bound `no_collapse` needs switched off."""
    enabled = training.get("guard_enabled")
    if enabled is None:
        return MISSING_FROM_PPO_RUN.format("guard_enabled")
    if enabled != 1.0:
        return GUARD_DISABLED
    for name in REQUIRED_GUARD_BOUNDS:
        if name not in training:
            return MISSING_FROM_PPO_RUN.format(name)
    off = [label for name, label in REQUIRED_GUARD_BOUNDS.items() if training[name] != 1.0]
    if off:
        return " and ".join(off) + " off"
    if training.get("guard_stopped") is None:
        return MISSING_FROM_PPO_RUN.format("guard_stopped")
    return None


def collapse_check(training: Mapping[str, float], required: bool = True) -> GateCheck:
    """`no_collapse`: the collapse guard watched the PPO run with its length band and KL bound on and did
    not stop it (`guard_stopped` 0). A run without the guard fails, shown as "guard disabled", one with a
    bound off as e.g. "length band off": nothing (or not enough) could have stopped it, so its
    `guard_stopped` 0 says nothing about collapse. Not `required`: passed, shown as not required."""
    stopped = training.get("guard_stopped")
    if not required:
        return GateCheck(name="no_collapse", value=stopped, bound=NO_COLLAPSE_BOUND, passed=True, note=NOT_REQUIRED)
    note = collapse_note(training)
    passed = note is None and stopped == 0.0
    return GateCheck(name="no_collapse", value=stopped, bound=NO_COLLAPSE_BOUND, passed=passed, note=note)


def gate_checks(
    settings: PromotionConfig,
    evaluation: Mapping[str, float],
    training: Mapping[str, float],
    against_sft: Mapping[str, float] | None = None,
) -> list[GateCheck]:
    """Every check of the gate on the evaluation's figures, the PPO run's and, while the baseline is a
    champion, the challenger's figures `against_sft` (None: the evaluation's baseline is the SFT model, so
    its figures are those); see the module docstring. A check whose bound is null is left out. The
    challenger passes when every check passes."""
    checks = evaluation_checks(settings, evaluation)
    if against_sft is not None:
        checks += drift_checks(settings, against_sft, MISSING_AGAINST_SFT, SFT_SUFFIX)
    max_kl = settings.max_kl
    if max_kl is not None:
        kl = training.get("val/kl_best")
        missing = MISSING_FROM_PPO_RUN.format("val/kl_best")
        checks.append(figure_check("kl_to_reference", kl, f"<= {max_kl:g}", lambda v: v <= max_kl, missing))
    checks.append(collapse_check(training, settings.require_no_collapse))
    return checks
