"""The promotion gate (tasks/promotion.py) on hand-made figures, and the rlhf-promote form's rules
(flows/promote.py): no servers, no models."""

import pytest
from pydantic import ValidationError

from flows.promote import PromoteSettings
from rlhf_core.config import PromotionConfig
from tasks.promotion import gate_checks

GOOD_EVALUATION = {"win_minus_loss": 0.3, "win_minus_loss_low": 0.05, "win_minus_loss_high": 0.55}
GOOD_TRAINING = {"val/kl_best": 0.12, "guard_stopped": 0.0}


def verdicts(checks) -> dict[str, bool]:
    return {check.name: check.passed for check in checks}


def test_a_challenger_that_wins_beyond_chance_close_to_its_reference_and_stable_passes() -> None:
    checks = gate_checks(PromotionConfig(), GOOD_EVALUATION, GOOD_TRAINING)
    assert verdicts(checks) == {"win_minus_loss_low": True, "kl_to_reference": True, "no_collapse": True}
    assert checks[0].describe() == "win_minus_loss_low = 0.05 (> 0): pass"


@pytest.mark.parametrize(
    ("evaluation", "training", "failing"),
    [
        ({**GOOD_EVALUATION, "win_minus_loss_low": 0.0}, GOOD_TRAINING, "win_minus_loss_low"),  # not above: fails
        ({}, GOOD_TRAINING, "win_minus_loss_low"),  # no valid pair: no interval
        (GOOD_EVALUATION, {**GOOD_TRAINING, "val/kl_best": 0.31}, "kl_to_reference"),
        (GOOD_EVALUATION, {"guard_stopped": 0.0}, "kl_to_reference"),  # a missing figure fails
        (GOOD_EVALUATION, {**GOOD_TRAINING, "guard_stopped": 1.0}, "no_collapse"),
        (GOOD_EVALUATION, {"val/kl_best": 0.1}, "no_collapse"),
    ],
)
def test_each_check_fails_alone(evaluation: dict, training: dict, failing: str) -> None:
    checks = gate_checks(PromotionConfig(), evaluation, training)
    assert [name for name, passed in verdicts(checks).items() if not passed] == [failing]
    (failed,) = [check for check in checks if not check.passed]
    assert failed.describe().endswith(": FAIL")


def test_the_bounds_come_from_the_promotion_section() -> None:
    settings = PromotionConfig(min_win_minus_loss_low=-0.2, max_kl=None, require_no_collapse=False)
    checks = gate_checks(settings, {"win_minus_loss_low": -0.1}, {"val/kl_best": 9.0, "guard_stopped": 1.0})
    assert verdicts(checks) == {"win_minus_loss_low": True}  # the KL and collapse checks are off
    assert checks[0].bound == "> -0.2"
    assert verdicts(
        gate_checks(PromotionConfig(max_kl=0.5), GOOD_EVALUATION, {**GOOD_TRAINING, "val/kl_best": 0.5})
    ) == {
        "win_minus_loss_low": True,
        "kl_to_reference": True,  # at the bound is within it
        "no_collapse": True,
    }


@pytest.mark.parametrize("reason", ["", "   "])
def test_an_override_without_a_reason_is_refused(reason: str) -> None:
    with pytest.raises(ValidationError, match="override needs a reason"):
        PromoteSettings(override=True, reason=reason)


def test_an_override_with_a_reason_is_accepted_but_not_with_a_rollback() -> None:
    assert PromoteSettings(override=True, reason="judged better by people").reason == "judged better by people"
    with pytest.raises(ValidationError, match="override applies to mode evaluate"):
        PromoteSettings(mode="rollback", override=True, reason="why not")
