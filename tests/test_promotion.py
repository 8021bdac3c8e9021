"""The rlhf-promote flow against a real MLflow registry (server with S3 artifacts) and a real Prefect server.

One module-scoped scenario on one policy model, and every test asserts on it. The policy versions name the
independent judge reward model registered with them (`lineage.judge_model` / `lineage.judge_version`, as the
pipeline's register step sets them), and no step configures a judge unless it says so:
  A. version 1 is the challenger and there is no champion: it is evaluated against the SFT model its
     lineage names, judged by its registered judge, passes the gate and becomes the champion with its
     evidence as tags;
  B. version 2 (its PPO run drifted: KL 0.9 > promotion.max_kl) is evaluated against the champion, fails,
     and the registry is left as it was;
  B2. the same with `promotion.judge_reward_model: in_sample`: judged by its own reward model, flagged so;
  C. an override without a reason is refused before anything runs;
  D. the same override with a reason promotes version 2 (the evaluation is a cache hit) and records it;
  E. a rollback moves the champion back to version 1; F. a second one finds nothing earlier and fails;
  G. version 3 names no judge and none is configured: the flow fails saying how to fix it, changing nothing.

The policies are copies of the tiny SFT model, told apart by a marker file, so both replies of every pair
are the same and every verdict is a tie: win minus loss is exactly 0 with a [0, 0] interval, which passes
`promotion.min_win_minus_loss_low = -0.5`, and the length-controlled win rate is exactly 0.5, which passes
`promotion.min_lc_win_rate_low = 0.4`; the length ratio is 1 and the alignment tax 0. What fails version 2
is the KL of its PPO run alone.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from fixtures.tiny_ppo import save_rm_output, write_stage_inputs
from mlflow import MlflowClient
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, FlowRunFilter, FlowRunFilterId
from prefect.states import State

from flows.promote import rlhf_promote
from rlhf_core.models.tiny import load_tiny_model
from rlhf_core.reward.training_data import training_data_record, write_training_data
from tasks.outputs import StageOutput, output_sha256
from tasks.promotion import CHAMPION_ALIAS, DECISION_TAG, PREVIOUS_CHAMPION_TAG, JudgeChoice, PromotionResult
from tasks.registry import (
    CHALLENGER_ALIAS,
    REWARD_VERSION_TAG,
    STAGE_RUN_TAG,
    judge_model_name,
    judge_version_tags,
    lineage_output_tags,
    register,
    training_data_tags,
)
from tasks.tracking import get_or_create_experiment

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

ROOT = Path(__file__).resolve().parents[1]
POLICY = "promotion-policy"
REWARD = "promotion-reward"
JUDGE = judge_model_name(REWARD)  # promotion-reward-judge
EXPERIMENT = "promotion-tests"
INDEPENDENT = (
    "independent reward model (trained on the PPO-prompt split, validated on rm_val, initialised from the base model)"
)


@dataclass
class Scenario:
    client: MlflowClient
    sft_dir: Path
    root: Path
    states: dict[str, State]
    tags_after: dict[str, dict[str, dict[str, str]]]  # step -> version -> tags
    champion_after: dict[str, str | None]  # step -> champion version
    artifacts: dict[str, dict[str, object]]  # step -> Prefect artifact key -> data
    task_states: dict[str, dict[str, str]]  # step -> task name -> final state name


def stage_output(stage: str, out_dir: Path, with_model: bool = True) -> StageOutput:
    model_dir = out_dir / "model" if with_model else None
    return StageOutput(stage=stage, out_dir=out_dir, sha256=output_sha256(out_dir, model_dir), model_dir=model_dir)


def ppo_run(client: MlflowClient, experiment_id: str, kl: float, guard_stopped: float) -> str:
    """An MLflow run standing for a PPO stage run: the final figures the gate reads."""
    run_id = client.create_run(experiment_id, run_name="ppo").info.run_id
    client.log_metric(run_id, "final.val/kl_best", kl, step=0)
    client.log_metric(run_id, "final.guard_enabled", 1.0, step=0)
    client.log_metric(run_id, "final.guard_stopped", guard_stopped, step=0)
    client.set_terminated(run_id)
    return run_id


def settings(runs_dir: Path, *overrides: str, **changes: object) -> dict[str, object]:
    return {
        "config": [str(ROOT / "configs" / "tiny.yaml")],
        "overrides": [
            f"tracking.policy_model_name={POLICY}",
            f"tracking.reward_model_name={REWARD}",
            f"tracking.experiment={EXPERIMENT}",
            "evaluation.max_prompts=6",
            "promotion.min_win_minus_loss_low=-0.5",
            "promotion.min_lc_win_rate_low=0.4",
            *overrides,
        ],
        "params_file": str(ROOT / "params.yaml"),
        "runs_dir": str(runs_dir),
        **changes,
    }


def artifacts_of(state: State) -> dict[str, object]:
    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[state.state_details.flow_run_id]))
        )
    return {artifact.key: artifact.data for artifact in artifacts if artifact.key}


def task_states(state: State) -> dict[str, str]:
    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[state.state_details.flow_run_id]))
        )
    return {run.name.rsplit("-", 1)[0]: run.state.name for run in runs}


@pytest.fixture(scope="module")
def scenario(tmp_path_factory: pytest.TempPathFactory, mlflow_server: str, prefect_server: str) -> Iterator[Scenario]:
    from prefect.settings import PREFECT_API_URL, temporary_settings

    root = tmp_path_factory.mktemp("promotion")
    inputs = write_stage_inputs(root)
    client = MlflowClient(mlflow_server)
    experiment_id = get_or_create_experiment(client, EXPERIMENT, None)
    register_run = client.create_run(experiment_id, run_name="register").info.run_id
    reward = register(client, mlflow_server, register_run, REWARD, stage_output("reward", inputs.rm_dir), {}, None)
    judge_dir = save_rm_output(root / "judge_reward", load_tiny_model()[1], seed=2)
    write_training_data(judge_dir, training_data_record(inputs.data_dir, "ppo_pairs", "base"))
    judge_output = stage_output("judge-reward", judge_dir)
    judge = register(
        client, mlflow_server, register_run, JUDGE, judge_output, training_data_tags(judge_output), None
    )
    lineage = lineage_output_tags(
        {
            "prepare-data": stage_output("prepare-data", inputs.data_dir, with_model=False),
            "sft": stage_output("sft", inputs.sft_dir),
        }
    )

    def register_policy(variant: str, kl: float, judged: bool = True) -> str:
        out_dir = root / f"policy-{variant}"
        shutil.copytree(inputs.sft_dir, out_dir)
        (out_dir / "model" / "variant.txt").write_text(variant)  # new content, the same weights
        tags = {
            **lineage,
            REWARD_VERSION_TAG: reward.version,
            STAGE_RUN_TAG: ppo_run(client, experiment_id, kl=kl, guard_stopped=0.0),
            **(judge_version_tags(judge) if judged else {}),
        }
        return register(
            client, mlflow_server, register_run, POLICY, stage_output("ppo", out_dir), tags, CHALLENGER_ALIAS
        ).version

    runs_dir = root / "runs"
    states: dict[str, State] = {}
    tags_after: dict[str, dict[str, dict[str, str]]] = {}
    champion_after: dict[str, str | None] = {}
    artifacts: dict[str, dict[str, object]] = {}
    task_states_of: dict[str, dict[str, str]] = {}

    def promote(step: str, parameters: dict[str, object]) -> None:
        states[step] = rlhf_promote(settings=parameters, return_state=True)
        versions = client.search_model_versions(f"name = '{POLICY}'")
        tags_after[step] = {str(version.version): dict(version.tags) for version in versions}
        champion_after[step] = client.get_registered_model(POLICY).aliases.get(CHAMPION_ALIAS)
        artifacts[step] = artifacts_of(states[step])
        task_states_of[step] = task_states(states[step])

    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    monkeypatch.setenv("PREFECT_API_URL", prefect_server)
    monkeypatch.chdir(root)
    try:
        with temporary_settings(updates={PREFECT_API_URL: prefect_server}):
            assert register_policy("1", kl=0.05) == "1"
            promote("A", settings(runs_dir))
            assert register_policy("2", kl=0.9) == "2"
            promote("B", settings(runs_dir))
            promote("B2", settings(runs_dir, "promotion.judge_reward_model=in_sample"))
            promote("C", settings(runs_dir, override=True))
            promote("D", settings(runs_dir, override=True, reason="people preferred it in the human evaluation"))
            promote("E", settings(runs_dir, mode="rollback", reason="complaints after the release"))
            promote("F", settings(runs_dir, mode="rollback"))
            assert register_policy("3", kl=0.05, judged=False) == "3"
            promote("G", settings(runs_dir))
        yield Scenario(client, inputs.sft_dir, root, states, tags_after, champion_after, artifacts, task_states_of)
    finally:
        monkeypatch.undo()


def result(scenario: Scenario, step: str) -> PromotionResult:
    state = scenario.states[step]
    assert state.is_completed(), state.message
    return state.result()


def test_without_a_champion_the_challenger_is_compared_with_sft_and_promoted_with_evidence(scenario: Scenario) -> None:
    first = result(scenario, "A")
    assert (first.decision, first.challenger, first.champion_before, first.champion_after) == (
        "promoted",
        "1",
        None,
        "1",
    )
    assert first.baseline == f"SFT model of version 1 ({scenario.sft_dir})"
    assert {check.name: check.passed for check in first.checks} == {
        "lc_win_rate_low": True,
        "win_minus_loss_low": True,
        "length_ratio": True,
        "alignment_tax_relative": True,
        "kl_to_reference": True,
        "no_collapse": True,
    }
    assert scenario.champion_after["A"] == "1"
    tags = scenario.tags_after["A"]["1"]
    assert tags[DECISION_TAG] == "promoted" and tags[PREVIOUS_CHAMPION_TAG] == "none"
    assert tags["promotion.gate"] == "passed"
    assert tags["promotion.check.kl_to_reference"] == "kl_to_reference = 0.05 (<= 0.3): pass"
    assert tags["promotion.check.win_minus_loss_low"] == "win_minus_loss_low = 0 (> -0.5): pass"
    assert tags["promotion.check.length_ratio"] == "length_ratio = 1 (in [0.67, 1.5]): pass"
    assert tags["promotion.check.no_collapse"] == "no_collapse = 0 (guard_enabled == 1 and guard_stopped == 0): pass"
    evaluation = scenario.client.get_run(tags["promotion.evaluation_run_id"])
    assert evaluation.data.metrics["final.tie_rate"] == 1.0  # the same weights: every pair a tie
    assert evaluation.data.metrics["final.score_diff_mean"] == 0.0  # identical replies, identical scores
    # The evaluation run names its inputs: registry models by their models:/ URI, the baseline by its path.
    assert evaluation.data.tags["input.model_a.uri"] == f"models:/{POLICY}/1"
    assert evaluation.data.tags["input.judge.uri"] == f"models:/{JUDGE}/1"
    assert evaluation.data.tags["input.model_b.path"] == str(scenario.sft_dir)
    assert "config.evaluation.sha256" in evaluation.data.tags and "git.commit" in evaluation.data.tags
    report = scenario.artifacts["A"]["promotion-decision"]
    assert (
        "# Promotion of `promotion-policy`: promoted" in report
        and "| kl_to_reference | 0.05 | <= 0.3 | pass |" in report
    )


def test_with_no_judge_configured_the_judge_registered_with_the_challenger_judges(scenario: Scenario) -> None:
    first = result(scenario, "A")
    assert first.judge == JudgeChoice(source="registered", reference=f"models:/{JUDGE}/1")
    assert first.judge_in_sample is False
    tags = scenario.tags_after["A"]["1"]
    assert (tags["promotion.judge"], tags["promotion.judge_source"], tags["promotion.judge_in_sample"]) == (
        f"models:/{JUDGE}/1",
        "registered",
        "false",
    )
    run_id = tags["promotion.evaluation_run_id"]
    assert scenario.client.get_run(run_id).data.metrics["final.judge_in_sample"] == 0.0
    report = json.loads(Path(scenario.client.download_artifacts(run_id, "report.json", str(scenario.root))).read_text())
    downloads = scenario.root / "runs" / ".cache" / "registry"
    assert report["judge"]["name"].startswith(f"reward model {downloads / JUDGE}-v1-")
    assert INDEPENDENT in report["judge"]["description"]  # its training_data.json, rebuilt from its tags
    assert f"judge: independent judge reward model registered with the challenger (models:/{JUDGE}/1)" in (
        scenario.artifacts["A"]["promotion-decision"]
    )


def test_a_failing_challenger_leaves_the_registry_unchanged_and_says_why(scenario: Scenario) -> None:
    second = result(scenario, "B")
    assert (second.decision, second.challenger, second.champion_after) == ("rejected", "2", "1")
    assert second.baseline == "promotion-policy version 1 (champion)"
    assert [check.name for check in second.checks if not check.passed] == ["kl_to_reference"]
    assert "kl_to_reference = 0.9 (<= 0.3): FAIL" in second.message
    assert scenario.champion_after["B"] == "1"
    assert scenario.tags_after["B"] == scenario.tags_after["A"] | {"2": scenario.tags_after["B"]["2"]}
    assert not any(key.startswith("promotion.") for key in scenario.tags_after["B"]["2"])
    assert "rejected" in scenario.artifacts["B"]["promotion-decision"]


def test_the_in_sample_judge_is_used_only_when_asked_and_is_flagged(scenario: Scenario) -> None:
    in_sample = result(scenario, "B2")
    assert in_sample.decision == "rejected" and in_sample.champion_after == "1"
    assert in_sample.judge == JudgeChoice(source="in_sample", reference=f"models:/{REWARD}/1")
    assert in_sample.judge_in_sample is True
    assert "Judged IN-SAMPLE: the reward model the challenger was optimised against" in in_sample.message
    assert "**IN-SAMPLE" in scenario.artifacts["B2"]["promotion-decision"]
    evaluation = scenario.client.get_run(in_sample.evaluation_run_id)
    assert evaluation.data.metrics["final.judge_in_sample"] == 1.0
    assert scenario.tags_after["B2"] == scenario.tags_after["B"]  # a rejection changes nothing


def test_a_challenger_without_a_registered_judge_fails_saying_how_to_fix_it(scenario: Scenario) -> None:
    failed = scenario.states["G"]
    assert failed.is_failed()
    message = str(failed.result(raise_on_failure=False))
    assert f"{POLICY} version 3 names no independent judge reward model" in message
    assert "promotion.judge_reward_model" in message and "in_sample" in message
    assert scenario.task_states["G"]["evaluation-inputs"] == "Failed" and "evaluate" not in scenario.task_states["G"]
    assert scenario.champion_after["G"] == "1"
    assert not any(key.startswith("promotion.") for key in scenario.tags_after["G"]["3"])


def test_an_override_without_a_reason_is_refused_before_anything_runs(scenario: Scenario) -> None:
    refused = scenario.states["C"]
    assert refused.is_failed() and "Validation of flow parameters failed" in refused.message
    assert "override needs a reason" in str(refused.result(raise_on_failure=False))
    assert scenario.task_states["C"] == {}
    assert scenario.champion_after["C"] == "1" and scenario.tags_after["C"] == scenario.tags_after["B"]


def test_an_override_with_a_reason_promotes_and_records_the_reason(scenario: Scenario) -> None:
    overridden = result(scenario, "D")
    assert (overridden.decision, overridden.champion_before, overridden.champion_after) == (
        "promoted-by-override",
        "1",
        "2",
    )
    assert scenario.task_states["D"]["evaluate"] == "Cached"  # the same comparison as in B
    tags = scenario.tags_after["D"]["2"]
    assert tags[DECISION_TAG] == "promoted-by-override" and tags["promotion.gate"] == "failed"
    assert tags["promotion.override_reason"] == "people preferred it in the human evaluation"
    assert tags[PREVIOUS_CHAMPION_TAG] == "1"
    assert scenario.champion_after["D"] == "2"


def test_rollback_restores_the_previous_champion_and_stops_at_the_first(scenario: Scenario) -> None:
    rolled_back = result(scenario, "E")
    assert (rolled_back.decision, rolled_back.champion_before, rolled_back.champion_after) == ("rolled-back", "2", "1")
    assert scenario.champion_after["E"] == "1"
    demoted = scenario.tags_after["E"]["2"]
    assert (
        demoted[DECISION_TAG] == "rolled-back"
        and demoted["promotion.rollback_reason"] == "complaints after the release"
    )
    assert scenario.tags_after["E"]["1"]["promotion.restored_from"] == "2"

    nothing_earlier = scenario.states["F"]
    assert nothing_earlier.is_failed() and "there is no earlier one to restore" in nothing_earlier.message
    assert scenario.champion_after["F"] == "1"
