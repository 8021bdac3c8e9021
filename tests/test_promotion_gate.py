"""The promotion gate (tasks/promotion.py) on hand-made figures, the choice of the judge from the config and the
challenger's tags, and the rlhf-promote form's rules (flows/promote.py): no servers, no models."""

from pathlib import Path

import pytest
from fixtures.tiny_ppo import tiny_config
from mlflow import MlflowClient
from mlflow.entities.model_registry import ModelVersion, ModelVersionTag
from pydantic import ValidationError

from flows.promote import PromoteSettings
from rlhf_core.config import PromotionConfig
from tasks.promotion import (
    GateCheck,
    JudgeChoice,
    PromotionResult,
    evidence_tags,
    find_candidates_task,
    gate_checks,
    promotion_judge,
    registered_version,
    reward_judge_choice,
)
from tasks.registry import JUDGE_MODEL_TAG, JUDGE_VERSION_TAG, REWARD_VERSION_TAG

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


# ---- the judge


def challenger(**tags: str) -> ModelVersion:
    return ModelVersion("rlhf-policy", "4", 0, tags=[ModelVersionTag(key, value) for key, value in tags.items()])


JUDGED = challenger(**{REWARD_VERSION_TAG: "2", JUDGE_MODEL_TAG: "rlhf-reward-judge", JUDGE_VERSION_TAG: "3"})


def test_by_default_the_judge_is_the_independent_one_registered_with_the_challenger() -> None:
    assert PromotionConfig().judge_reward_model is None
    choice = reward_judge_choice(None, JUDGED, "rlhf-reward")
    assert choice == JudgeChoice(source="registered", reference="models:/rlhf-reward-judge/3")
    assert choice.describe() == (
        "independent judge reward model registered with the challenger (models:/rlhf-reward-judge/3)"
    )


def test_without_a_registered_judge_the_default_fails_saying_how_to_fix_it() -> None:
    with pytest.raises(ValueError) as error:
        reward_judge_choice(None, challenger(**{REWARD_VERSION_TAG: "2"}), "rlhf-reward")
    message = str(error.value)
    assert message.startswith("rlhf-policy version 4 names no independent judge reward model")
    fixes = ("evaluation.judge_rm: independent", "promotion.judge_reward_model", "in_sample", "evaluation.judge: llm")
    assert all(fix in message for fix in fixes)


def test_the_in_sample_judge_must_be_asked_for_and_a_given_one_is_used_as_given() -> None:
    in_sample = reward_judge_choice("in_sample", JUDGED, "rlhf-reward")
    assert in_sample == JudgeChoice(source="in_sample", reference="models:/rlhf-reward/2")
    assert "promotion.judge_reward_model: in_sample" in in_sample.describe()
    with pytest.raises(ValueError, match="no rlhf.reward_model_version tag"):
        reward_judge_choice("in_sample", challenger(), "rlhf-reward")
    for given in ("models:/my-judge@production", "/models/judge-rm"):
        choice = reward_judge_choice(given, challenger(), "rlhf-reward")
        assert choice == JudgeChoice(source="configured", reference=given)


def test_an_llm_judge_takes_precedence_and_needs_no_reward_model(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RLHF_JUDGE_API_KEY", "test-key")
    monkeypatch.setenv("RLHF_JUDGE_MODEL", "judge-model-x")
    config = tiny_config("evaluation.judge=llm", "promotion.judge_reward_model=/nowhere")
    spec, choice = promotion_judge(config, challenger(), "sqlite:///unused.db", Path("unused"))
    assert (spec.kind, spec.llm_model, spec.reward) == ("llm", "judge-model-x", None)
    assert choice == JudgeChoice(source="llm", reference="judge-model-x")


def test_an_in_sample_judge_is_flagged_in_the_decision_and_its_tags() -> None:
    check = GateCheck(name="win_minus_loss_low", value=0.1, bound="> 0", passed=True)
    result = PromotionResult(
        decision="promoted",
        model="rlhf-policy",
        challenger="4",
        baseline="SFT",
        checks=[check],
        judge=JudgeChoice(source="in_sample", reference="models:/rlhf-reward/2"),
        judge_in_sample=True,
        message="promoted",
    )
    tags = evidence_tags(result)
    assert (tags["promotion.judge"], tags["promotion.judge_source"], tags["promotion.judge_in_sample"]) == (
        "models:/rlhf-reward/2",
        "in_sample",
        "true",
    )
    assert "**IN-SAMPLE: the reward model the challenger was optimised against" in result.markdown()
    independent = result.model_copy(update={"judge": reward_judge_choice(None, JUDGED, "r"), "judge_in_sample": False})
    assert evidence_tags(independent)["promotion.judge_in_sample"] == "false"
    assert "IN-SAMPLE" not in independent.markdown()


def test_candidates_from_a_local_sqlite_store(tmp_path: Path) -> None:
    """A local SQLite MLflow store answers alias versions as ints (a tracking server as strings)."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    config = tiny_config()
    name = config.tracking.policy_model_name
    client.create_registered_model(name)
    for _ in range(2):
        client.create_model_version(name, source=str(tmp_path))
    client.set_registered_model_alias(name, "challenger", "2")
    client.set_registered_model_alias(name, "champion", "1")
    candidates = find_candidates_task.fn(config, uri)
    assert (candidates.challenger, candidates.champion) == ("2", "1")
    assert registered_version(None) is None
