"""The promotion gate (rlhf_core/promotion/gate.py) on hand-made figures: each check passing, failing alone and
missing, a run without the guard shown as such; the choice of the judge from the config and the
challenger's tags, and the rlhf-promote form's rules (flows/promote.py): no servers, no models."""

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from flows.promote import PromoteSettings
from rlhf_core.config import PromotionConfig
from rlhf_core.evaluation.ppo_evidence import ppo_evidence_markdown
from rlhf_core.evaluation.refusal import RefusalFigures
from rlhf_core.promotion.evidence import IDENTICAL_MODELS, identical_models_evidence
from rlhf_core.promotion.gate import NO_COLLAPSE_BOUND, NOT_IDENTIFIABLE, NOT_REQUIRED
from rlhf_core.stages.ppo import sft_reward_length_spearman
from tasks.promotion.figures import figures_against_sft
from tasks.promotion.promote_tasks import GateCheck, PromotionResult, gate_checks


def drop(figures: dict[str, float], name: str) -> dict[str, float]:
    """`figures` without `name` (an evaluation or PPO run from before that figure existed)."""
    return {key: value for key, value in figures.items() if key != name}


GOOD_EVALUATION = {
    "win_minus_loss": 0.3,
    "win_minus_loss_low": 0.05,
    "win_minus_loss_high": 0.55,
    "lc_identifiable": 1.0,
    "lc_win_rate": 0.62,
    "lc_win_rate_low": 0.53,
    "lc_win_rate_high": 0.7,
    "length_ratio": 0.92,
    "alignment_tax_relative": 0.01,
}
GOOD_TRAINING = {
    "val/kl_best": 0.12,
    "guard_stopped": 0.0,
    "guard_enabled": 1.0,
    "guard_length_band": 1.0,
    "guard_kl_bound": 1.0,
}
EVERY_CHECK = [
    "lc_win_rate_low",
    "win_minus_loss_low",
    "length_ratio",
    "alignment_tax_relative",
    "kl_to_reference",
    "no_collapse",
]


def verdicts(checks) -> dict[str, bool]:
    return {check.name: check.passed for check in checks}


def by_name(checks) -> dict[str, GateCheck]:
    return {check.name: check for check in checks}


def test_a_challenger_that_wins_beyond_length_close_to_its_reference_and_stable_passes() -> None:
    checks = gate_checks(PromotionConfig(), GOOD_EVALUATION, GOOD_TRAINING)
    assert verdicts(checks) == dict.fromkeys(EVERY_CHECK, True)
    assert [check.describe() for check in checks] == [
        "lc_win_rate_low = 0.53 (> 0.5): pass",
        "win_minus_loss_low = 0.05 (> 0): pass",
        "length_ratio = 0.92 (in [0.67, 1.5]): pass",
        "alignment_tax_relative = 0.01 (<= 0.05): pass",
        "kl_to_reference = 0.12 (<= 0.3): pass",
        "no_collapse = 0 (guard on with length band and KL bound, guard_stopped == 0): pass",
    ]


@pytest.mark.parametrize(
    ("evaluation", "training", "failing"),
    [
        ({**GOOD_EVALUATION, "lc_win_rate_low": 0.5}, GOOD_TRAINING, "lc_win_rate_low"),  # even is not above even
        ({**GOOD_EVALUATION, "win_minus_loss_low": 0.0}, GOOD_TRAINING, "win_minus_loss_low"),  # not above: fails
        ({**GOOD_EVALUATION, "length_ratio": 0.35}, GOOD_TRAINING, "length_ratio"),  # the 22 vs 62 tokens
        ({**GOOD_EVALUATION, "length_ratio": 1.51}, GOOD_TRAINING, "length_ratio"),
        ({**GOOD_EVALUATION, "alignment_tax_relative": 0.051}, GOOD_TRAINING, "alignment_tax_relative"),
        (GOOD_EVALUATION, {**GOOD_TRAINING, "val/kl_best": 0.31}, "kl_to_reference"),
        (GOOD_EVALUATION, {**GOOD_TRAINING, "guard_stopped": 1.0}, "no_collapse"),
        (GOOD_EVALUATION, {**GOOD_TRAINING, "guard_enabled": 0.0}, "no_collapse"),
        (GOOD_EVALUATION, {**GOOD_TRAINING, "guard_length_band": 0.0}, "no_collapse"),
        (GOOD_EVALUATION, {**GOOD_TRAINING, "guard_kl_bound": 0.0}, "no_collapse"),
        ({**GOOD_EVALUATION, "lc_identifiable": 0.0}, GOOD_TRAINING, "lc_win_rate_low"),
    ],
)
def test_each_check_fails_alone(evaluation: dict, training: dict, failing: str) -> None:
    checks = gate_checks(PromotionConfig(), evaluation, training)
    assert [name for name, passed in verdicts(checks).items() if not passed] == [failing]
    (failed,) = [check for check in checks if not check.passed]
    assert failed.describe().endswith(": FAIL")


@pytest.mark.parametrize(
    ("evaluation", "training", "failing", "says"),
    [
        (drop(GOOD_EVALUATION, "lc_win_rate_low"), GOOD_TRAINING, "lc_win_rate_low", "evaluation's metrics.json"),
        (drop(GOOD_EVALUATION, "win_minus_loss_low"), GOOD_TRAINING, "win_minus_loss_low", "no valid verdict"),
        (drop(GOOD_EVALUATION, "length_ratio"), GOOD_TRAINING, "length_ratio", "evaluation's metrics.json"),
        (
            drop(GOOD_EVALUATION, "alignment_tax_relative"),
            GOOD_TRAINING,
            "alignment_tax_relative",
            "evaluation's metrics.json",
        ),
        (GOOD_EVALUATION, drop(GOOD_TRAINING, "val/kl_best"), "kl_to_reference", "val/kl_best is not in its PPO run"),
        (GOOD_EVALUATION, drop(GOOD_TRAINING, "guard_stopped"), "no_collapse", "guard_stopped is not in its PPO run"),
        (GOOD_EVALUATION, drop(GOOD_TRAINING, "guard_enabled"), "no_collapse", "guard_enabled is not in its PPO run"),
        (GOOD_EVALUATION, drop(GOOD_TRAINING, "guard_length_band"), "no_collapse", "guard_length_band is not in"),
        (drop(GOOD_EVALUATION, "lc_identifiable"), GOOD_TRAINING, "lc_win_rate_low", "lc_identifiable is not in"),
    ],
)
def test_a_missing_figure_fails_its_check_saying_it_is_missing(
    evaluation: dict, training: dict, failing: str, says: str
) -> None:
    checks = gate_checks(PromotionConfig(), evaluation, training)
    assert [name for name, passed in verdicts(checks).items() if not passed] == [failing]
    failed = by_name(checks)[failing]
    assert failed.describe().startswith(f"{failing} = missing: ") and says in failed.describe()
    assert failed.describe().endswith(": FAIL")


def test_an_evaluation_from_before_the_length_controlled_judgement_fails_on_each_new_figure() -> None:
    old = {"win_minus_loss": 0.3, "win_minus_loss_low": 0.05, "win_minus_loss_high": 0.55, "alignment_tax": 0.4}
    checks = by_name(gate_checks(PromotionConfig(), old, GOOD_TRAINING))
    assert [name for name, check in checks.items() if not check.passed] == [
        "lc_win_rate_low",
        "length_ratio",
        "alignment_tax_relative",
    ]
    assert checks["length_ratio"].describe() == (
        "length_ratio = missing: length_ratio is not in the evaluation's metrics.json (evaluated before it "
        "existed?) (in [0.67, 1.5]): FAIL"
    )


def test_a_run_without_the_guard_is_reported_as_guard_disabled_never_as_no_collapse() -> None:
    unguarded = {**GOOD_TRAINING, "guard_enabled": 0.0}  # the guard never fired: it was off
    check = by_name(gate_checks(PromotionConfig(), GOOD_EVALUATION, unguarded))["no_collapse"]
    assert not check.passed and check.shown_value() == "guard disabled"
    assert check.value == 0.0  # the figure is kept, but never shown as a clean bill
    assert check.describe() == f"no_collapse = guard disabled ({NO_COLLAPSE_BOUND}): FAIL"
    result = PromotionResult(decision="rejected", model="rlhf-policy", checks=[check], message="rejected")
    assert f"| no_collapse | guard disabled | {NO_COLLAPSE_BOUND} | FAIL |" in result.markdown()


@pytest.mark.parametrize(
    ("guard", "shown"),
    [
        ({"guard_length_band": 0.0}, "length band off"),
        ({"guard_kl_bound": 0.0}, "KL bound off"),
        ({"guard_length_band": 0.0, "guard_kl_bound": 0.0}, "length band and KL bound off"),
    ],
)
def test_a_run_with_the_length_band_or_the_kl_bound_off_fails_no_collapse_saying_which(guard: dict, shown: str) -> None:
    check = by_name(gate_checks(PromotionConfig(), GOOD_EVALUATION, {**GOOD_TRAINING, **guard}))["no_collapse"]
    assert not check.passed and check.shown_value() == shown


def test_a_gate_told_not_to_require_no_collapse_records_it_in_the_decision() -> None:
    unguarded = {**GOOD_TRAINING, "guard_enabled": 0.0, "guard_length_band": 0.0, "guard_kl_bound": 0.0}
    check = by_name(gate_checks(PromotionConfig(require_no_collapse=False), GOOD_EVALUATION, unguarded))["no_collapse"]
    assert check.passed
    assert check.describe() == f"no_collapse = {NOT_REQUIRED} ({NO_COLLAPSE_BOUND}): pass"


def test_an_unidentified_length_controlled_rate_fails_shown_as_not_identifiable_never_as_a_number() -> None:
    unidentified = {**drop(drop(GOOD_EVALUATION, "lc_win_rate_low"), "lc_win_rate"), "lc_identifiable": 0.0}
    check = by_name(gate_checks(PromotionConfig(), unidentified, GOOD_TRAINING))["lc_win_rate_low"]
    assert not check.passed and check.value is None
    assert check.describe() == f"lc_win_rate_low = {NOT_IDENTIFIABLE} (> 0.5): FAIL"


def test_identical_models_never_pass_the_gate_however_permissive_its_bounds() -> None:
    """A challenger whose content is its baseline's ties on every pair: bounds that a tie passes still do
    not make it a win."""
    permissive = PromotionConfig(min_lc_win_rate_low=0.4, min_win_minus_loss_low=-0.5)
    evidence = identical_models_evidence("ab" * 32)
    checks = by_name(gate_checks(permissive, evidence.metrics, GOOD_TRAINING))
    assert checks["lc_win_rate_low"].passed and checks["win_minus_loss_low"].passed  # a tie, within these bounds
    assert not checks["differs_from_baseline"].passed
    assert checks["differs_from_baseline"].describe() == (
        "differs_from_baseline = identical models, not evaluated (content differs from the baseline's): FAIL"
    )
    assert "differs_from_baseline" not in by_name(gate_checks(permissive, GOOD_EVALUATION, GOOD_TRAINING))


def test_the_bounds_come_from_the_promotion_section() -> None:
    settings = PromotionConfig(
        min_lc_win_rate_low=None,
        min_win_minus_loss_low=-0.2,
        min_length_ratio=None,
        max_length_ratio=None,
        max_alignment_tax=None,
        max_kl=None,
        require_no_collapse=False,
    )
    checks = gate_checks(settings, {"win_minus_loss_low": -0.1}, {"val/kl_best": 9.0, "guard_stopped": 1.0})
    assert verdicts(checks) == {"win_minus_loss_low": True, "no_collapse": True}  # every other check is off
    assert checks[0].bound == "> -0.2" and checks[1].shown_value() == NOT_REQUIRED  # off, and said so
    at_the_bounds = {**GOOD_EVALUATION, "lc_win_rate_low": 0.41, "length_ratio": 2.0, "alignment_tax_relative": 0.1}
    settings = PromotionConfig(min_lc_win_rate_low=0.4, max_length_ratio=2.0, max_alignment_tax=0.1, max_kl=0.5)
    assert verdicts(gate_checks(settings, at_the_bounds, {**GOOD_TRAINING, "val/kl_best": 0.5})) == dict.fromkeys(
        EVERY_CHECK, True
    )  # at a bound is within it
    one_sided = PromotionConfig(min_length_ratio=None)
    assert by_name(gate_checks(one_sided, GOOD_EVALUATION, GOOD_TRAINING))["length_ratio"].bound == "<= 1.5"


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"min_length_ratio": 1.0, "max_length_ratio": 1.0}, "min_length_ratio 1 must be < max_length_ratio 1"),
        ({"min_length_ratio": 1.5}, "min_length_ratio"),  # a band must hold the unchanged length (ratio 1)
        ({"max_length_ratio": 0.9}, "max_length_ratio"),
        ({"min_lc_win_rate_low": 1.0}, "min_lc_win_rate_low"),
        ({"max_alignment_tax": -0.1}, "max_alignment_tax"),
    ],
)
def test_bad_bounds_are_refused_naming_the_key(settings: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        PromotionConfig(**settings)


@pytest.mark.parametrize("reason", ["", "   "])
def test_an_override_without_a_reason_is_refused(reason: str) -> None:
    with pytest.raises(ValidationError, match="override needs a reason"):
        PromoteSettings(override=True, reason=reason)


def test_an_override_with_a_reason_is_accepted_but_not_with_a_rollback() -> None:
    assert PromoteSettings(override=True, reason="judged better by people").reason == "judged better by people"
    with pytest.raises(ValidationError, match="override applies to mode evaluate"):
        PromoteSettings(mode="rollback", override=True, reason="why not")


@pytest.mark.parametrize(
    ("figures", "line"),
    [
        ({"guard_enabled": 1.0, "guard_stopped": 0.0}, "- collapse guard: did not fire"),
        ({"guard_enabled": 1.0, "guard_stopped": 1.0, "guard_stop_step": 7.0}, "stopped the run at iteration 7"),
        ({"guard_enabled": 0.0, "guard_stopped": 0.0}, "- collapse guard: was disabled (every ppo.guard bound null)"),
    ],
)
def test_the_evaluation_report_says_when_the_guard_was_off(tmp_path: Path, figures: dict, line: str) -> None:
    gain = {"prompts": 4, "mean": 0.1, "low": -0.1, "high": 0.3}
    selection = {"chosen_step": 3, "reason": "latest", "gain_over_initial": gain}
    (tmp_path / "selection.json").write_text(json.dumps(selection))
    metrics = {"steps_completed": 3.0, "val/kl_best": 0.02, "critic_pretrain_steps": 1.0, **figures}
    (tmp_path / "metrics.json").write_text(json.dumps(metrics))
    evidence = ppo_evidence_markdown(tmp_path)
    assert evidence is not None and line in evidence


def test_against_a_champion_the_band_and_the_tax_hold_to_the_sft_model_too_naming_both_figures() -> None:
    """Five promotions each shortening by a fifth pass against each champion, but not against SFT."""
    drifted = {"length_ratio": 0.8**5, "alignment_tax_relative": 0.04 * 5}
    checks = by_name(gate_checks(PromotionConfig(), GOOD_EVALUATION, GOOD_TRAINING, drifted))
    assert checks["length_ratio"].passed and checks["alignment_tax_relative"].passed  # against the champion
    assert [name for name, check in checks.items() if not check.passed] == [
        "length_ratio_vs_sft",
        "alignment_tax_relative_vs_sft",
    ]
    assert checks["length_ratio_vs_sft"].describe() == "length_ratio_vs_sft = 0.32768 (in [0.67, 1.5]): FAIL"
    close = {"length_ratio": 0.9, "alignment_tax_relative": 0.02}
    assert all(check.passed for check in gate_checks(PromotionConfig(), GOOD_EVALUATION, GOOD_TRAINING, close))
    missing = by_name(gate_checks(PromotionConfig(), GOOD_EVALUATION, GOOD_TRAINING, {"length_ratio": 0.9}))
    assert missing["alignment_tax_relative_vs_sft"].shown_value() == (
        "missing: the challenger has no evaluation.alignment_tax_relative tag (its pipeline run's evaluation "
        "against its SFT model)"
    )
    unbounded = PromotionConfig(min_length_ratio=None, max_length_ratio=None, max_alignment_tax=None)
    assert "length_ratio_vs_sft" not in by_name(gate_checks(unbounded, GOOD_EVALUATION, GOOD_TRAINING, drifted))


def test_the_figures_against_sft_come_from_the_challengers_evaluation_tags() -> None:
    tags = {
        "evaluation.status": "evaluated",
        "evaluation.judge": "rm",
        "evaluation.baseline": "SFT model",
        "evaluation.length_ratio": "0.81",
        "evaluation.alignment_tax_relative": "0.012",
        "rlhf.content_sha256": "ab" * 32,
    }
    assert figures_against_sft(tags) == {"length_ratio": 0.81, "alignment_tax_relative": 0.012}
    identical = figures_against_sft({"evaluation.status": IDENTICAL_MODELS})
    assert (identical["length_ratio"], identical["alignment_tax_relative"]) == (1.0, 0.0)


POLICY_REWARD_AT_CHANCE = {
    "val/length_matched_accuracy": 0.55,
    "val/length_matched_accuracy_low": 0.43,
    "val/length_matched_accuracy_high": 0.66,
    "val/auc_gain_over_length": 0.01,
    "val/auc_gain_over_length_low": -0.02,
    "val/auc_gain_over_length_high": 0.04,
}
JUDGE_SKILLED = {
    "val/length_matched_accuracy": 0.74,
    "val/length_matched_accuracy_low": 0.65,
    "val/length_matched_accuracy_high": 0.82,
    "val/auc_gain_over_length": 0.12,
    "val/auc_gain_over_length_low": 0.08,
    "val/auc_gain_over_length_high": 0.16,
}
REFUSED_EVALUATION = {
    "length_ratio": 0.75,
    "length_matched/pairs": 41.0,
    "length_matched/win_minus_loss": 0.05,
    "length_matched/win_minus_loss_low": -0.2,
    "length_matched/win_minus_loss_high": 0.29,
}


def test_a_refusal_says_what_limits_it_from_the_measured_figures() -> None:
    # the PPO stage's own figure, from its rollouts of the SFT policy
    training = {**GOOD_TRAINING, **sft_reward_length_spearman([{"step": 1, "reward/length_spearman": -0.55}], 0)}
    figures = RefusalFigures.gather(POLICY_REWARD_AT_CHANCE, JUDGE_SKILLED, training, REFUSED_EVALUATION)
    assert figures.paragraph() == (
        "Why: the policy reward model ranks length-matched pairs at chance (0.55 (0.43-0.66)): PPO can learn "
        "little from it but length; more preference pairs or a larger base model are needed. Measured: policy "
        "reward model length-matched accuracy 0.55 (0.43-0.66), AUC gain over length +0.01 (-0.02 to +0.04); "
        "judge length-matched accuracy 0.74 (0.65-0.82), AUC gain over length +0.12 (+0.08 to +0.16); "
        "reward-length Spearman on the SFT policy's replies -0.55; evaluation length ratio 0.75, 41 "
        "length-matched pairs, win - lose +0.05 (-0.20 to +0.29)."
    )
    # the next limit in line once the policy reward model sees beyond length
    skilled = RefusalFigures.gather(JUDGE_SKILLED, POLICY_REWARD_AT_CHANCE, training, REFUSED_EVALUATION)
    assert skilled.limit().startswith("the judge ranks length-matched pairs at chance (0.55 (0.43-0.66))")
    few = RefusalFigures.gather(JUDGE_SKILLED, JUDGE_SKILLED, training, REFUSED_EVALUATION)
    assert few.limit().startswith("the evaluation judged 41 length-matched pairs, fewer than 60")
    enough = RefusalFigures.gather(JUDGE_SKILLED, None, training, {**REFUSED_EVALUATION, "length_matched/pairs": 80})
    assert enough.limit().endswith("measured no gain beyond length that clears the gate")
    assert "judge n/a (not a reward model)" in enough.paragraph()
    unknown = RefusalFigures.gather({}, {}, {}, {})  # nothing measured: nothing named as the limit
    assert "n/a" in unknown.paragraph() and not unknown.policy_reward.at_chance


def test_the_decision_shows_the_explanation_under_the_failed_checks() -> None:
    checks = gate_checks(PromotionConfig(), {**GOOD_EVALUATION, "length_ratio": 0.5}, GOOD_TRAINING)
    explanation = RefusalFigures.gather(POLICY_REWARD_AT_CHANCE, None, {}, REFUSED_EVALUATION).paragraph()
    result = PromotionResult(
        decision="rejected", model="rlhf-policy", checks=checks, explanation=explanation, message="rejected"
    )
    markdown, summary = result.markdown(), result.summary()
    assert markdown.index("| length_ratio | 0.5 |") < markdown.index(explanation)
    assert summary.splitlines()[-1] == f"  {explanation}"
