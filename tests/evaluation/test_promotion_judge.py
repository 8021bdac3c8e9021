"""Which judge a promotion uses (tasks/promotion/promote_tasks.py): the independent one registered with the
challenger by default, the in-sample reward model only when asked (and flagged), a given one as given, an LLM
judge first; and the candidates read from a local registry.
"""

from pathlib import Path

import pytest
from mlflow import MlflowClient
from mlflow.entities.model_registry import ModelVersion, ModelVersionTag

from fixtures.tiny_ppo import tiny_config
from rlhf_core.config import PromotionConfig
from tasks.promotion.promote_tasks import (
    GateCheck,
    JudgeChoice,
    PromotionResult,
    evidence_tags,
    find_candidates_task,
    promotion_judge,
    reward_judge_choice,
    version_number,
)
from tasks.registry.registered_models import JUDGE_MODEL_TAG, JUDGE_VERSION_TAG, REWARD_VERSION_TAG


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


def test_candidates_from_a_local_sqlite_store(mlflow_db: str, tmp_path: Path) -> None:
    """A local SQLite MLflow store answers alias versions as ints (a tracking server as strings)."""
    uri = mlflow_db
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
    assert version_number(None) is None
