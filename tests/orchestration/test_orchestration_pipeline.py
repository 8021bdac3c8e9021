"""The whole pipeline the way production runs it: real Prefect and MLflow servers (artifacts in S3), the
deployments served by a separate process (`rlhf serve`), and flow runs created through the Prefect API
with parameters, as the UI's Run button does.

One module-scoped scenario runs the tiny pipeline three times and every test asserts on it:
  A. the first run: every stage runs;
  B. the same settings again: every stage is a cache hit, the registry keeps its versions;
  C. one PPO parameter changed: PPO, evaluation and registration run again, the stages before it stay
     cached, and a new policy version becomes the challenger.
(A deleted output being recomputed is checked in tests/orchestration/test_orchestration_flow.py, in-process.)
"""

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import mlflow
import pytest
from mlflow import MlflowClient
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, FlowRunFilter, FlowRunFilterId
from prefect.client.schemas.objects import FlowRun
from prefect.deployments import run_deployment
from prefect.exceptions import ObjectNotFound
from prefect.settings import PREFECT_API_URL, temporary_settings

from fixtures.pairs import write_topic_pairs
from fixtures.paths import PARAMS, ROOT, TINY
from fixtures.servers import log_tail, start_server, stop_server
from tasks.registry.registered_models import (
    CHALLENGER_ALIAS,
    EVALUATION_STATUS_TAG,
    JUDGE_MODEL_TAG,
    JUDGE_VERSION_TAG,
    PIPELINE_RUN_TAG,
    REWARD_VERSION_TAG,
    STAGE_RUN_TAG,
)
from tasks.tracking.lineage import CONFIG_TAG, DATA_VERSION_TAG, DEPENDENCIES_TAG, FLOW_RUN_ID_TAG, GIT_COMMIT_TAG
from tasks.tracking.mlflow_runs import PARENT_RUN_TAG, ROLE_TAG, STAGE_TAG

pytestmark = pytest.mark.slow

DEPLOYMENT = "rlhf-pipeline/rlhf-pipeline"
SERVE_START_TIMEOUT_S = 120.0
FLOW_RUN_TIMEOUT_S = 600
STAGES = ("prepare-data", "sft", "reward", "judge-reward", "ppo", "evaluate", "register")


@dataclass
class PipelineRun:
    """One flow run of the scenario, as the Prefect server recorded it."""

    flow_run: FlowRun
    task_states: dict[str, str]  # task name -> final state name ("Completed", "Cached", ...)
    artifacts: dict[str, object]  # artifact key -> data


@dataclass
class Scenario:
    project: Path
    tracking_uri: str
    runs: dict[str, PipelineRun]


def wait_for_deployment(server, deadline_s: float) -> None:
    """Poll the Prefect API until the serving process has registered the deployment."""
    deadline = time.monotonic() + deadline_s
    with get_client(sync_client=True) as client:
        while True:
            try:
                client.read_deployment_by_name(DEPLOYMENT)
                return
            except ObjectNotFound:
                pass
            if server.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"`rlhf serve` did not register {DEPLOYMENT}; log:\n{log_tail(server.log_path)}")
            time.sleep(0.5)


def run_and_record(parameters: dict) -> PipelineRun:
    """Create a flow run of the deployment with `parameters` (as the UI does) and wait for its end."""
    flow_run = run_deployment(DEPLOYMENT, parameters=parameters, timeout=FLOW_RUN_TIMEOUT_S)
    with get_client(sync_client=True) as client:
        in_run = FlowRunFilter(id=FlowRunFilterId(any_=[flow_run.id]))
        task_runs = client.read_task_runs(flow_run_filter=in_run)
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run.id]))
        )
    return PipelineRun(
        flow_run=flow_run,
        task_states={run.name.rsplit("-", 1)[0]: run.state.name for run in task_runs},
        artifacts={artifact.key: artifact.data for artifact in artifacts if artifact.key},
    )


@pytest.fixture(scope="module")
def scenario(tmp_path_factory: pytest.TempPathFactory, prefect_server: str, mlflow_server: str) -> Iterator[Scenario]:
    project = tmp_path_factory.mktemp("project")
    data = write_topic_pairs(project / "pairs.jsonl", 160)
    env = {
        **os.environ,
        "PREFECT_API_URL": prefect_server,
        "MLFLOW_TRACKING_URI": mlflow_server,
        "PREFECT_RUNNER_POLL_FREQUENCY": "1",  # pick up new flow runs within a second
    }
    command = [sys.executable, "-c", "from rlhf_cli.run_commands import serve; serve()"]
    server = start_server("rlhf serve", command, env, project / "serve.log")
    settings = {
        "config": [str(TINY)],
        "data": str(data),
        "params_file": str(PARAMS),
        # The tiny overlay's PPO, one iteration shorter, at a learning rate at which it hands on a trained
        # policy (at the overlay's 1e-4 it hands on its start, which is not evaluated: test_identical_evaluation).
        "overrides": ["ppo.steps=2", "ppo.policy_lr=2e-4"],
    }
    runs: dict[str, PipelineRun] = {}
    try:
        with temporary_settings(updates={PREFECT_API_URL: prefect_server}):
            wait_for_deployment(server, SERVE_START_TIMEOUT_S)
            runs["A"] = run_and_record({"settings": settings})
            runs["B"] = run_and_record({"settings": settings})
            runs["C"] = run_and_record(
                {"settings": {**settings, "overrides": ["ppo.steps=2", "ppo.policy_lr=2e-4", "ppo.critic_lr=2e-4"]}}
            )
        yield Scenario(project=project, tracking_uri=mlflow_server, runs=runs)
    finally:
        stop_server(server)


def parent_run(client: MlflowClient, run: PipelineRun):
    experiment = client.get_experiment_by_name("rlhf-pipeline")
    (parent,) = client.search_runs(
        [experiment.experiment_id],
        filter_string=f"tags.`{FLOW_RUN_ID_TAG}` = '{run.flow_run.id}' and tags.`{ROLE_TAG}` = 'pipeline'",
    )
    return parent


def child_runs(client: MlflowClient, parent) -> dict[str, object]:
    children = client.search_runs(
        [parent.info.experiment_id], filter_string=f"tags.`{PARENT_RUN_TAG}` = '{parent.info.run_id}'"
    )
    return {child.data.tags[STAGE_TAG]: child for child in children}


def test_flow_run_created_through_the_api_completes_every_stage(scenario: Scenario) -> None:
    first = scenario.runs["A"]
    assert first.flow_run.state.is_completed(), first.flow_run.state.message
    assert first.flow_run.parameters["settings"]["data"].endswith("pairs.jsonl")
    assert first.task_states == {stage: "Completed" for stage in STAGES}


def test_unchanged_rerun_is_all_cache_hits(scenario: Scenario) -> None:
    second = scenario.runs["B"]
    assert second.flow_run.state.is_completed(), second.flow_run.state.message
    cached = {stage: "Cached" for stage in STAGES if stage != "register"}
    assert second.task_states == {**cached, "register": "Completed"}


def test_changed_ppo_parameter_reruns_ppo_and_what_follows_only(scenario: Scenario) -> None:
    third = scenario.runs["C"]
    assert third.flow_run.state.is_completed(), third.flow_run.state.message
    assert third.task_states == {
        "prepare-data": "Cached",
        "sft": "Cached",
        "reward": "Cached",
        "judge-reward": "Cached",
        "ppo": "Completed",
        "evaluate": "Completed",
        "register": "Completed",
    }


def test_mlflow_holds_a_parent_run_with_lineage_and_nested_stage_runs(scenario: Scenario) -> None:
    client = MlflowClient(scenario.tracking_uri)
    parent = parent_run(client, scenario.runs["A"])
    assert parent.info.status == "FINISHED"
    commit = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()
    tags = parent.data.tags
    assert tags[GIT_COMMIT_TAG] == commit
    assert len(tags[DEPENDENCIES_TAG]) == 64 and len(tags[CONFIG_TAG]) == 64 and len(tags[DATA_VERSION_TAG]) == 64
    assert parent.data.params["ppo.clip_eps"] == "0.2" and parent.data.params["model.kind"] == "tiny"
    assert parent.data.params["data.source"] == scenario.runs["A"].flow_run.parameters["settings"]["data"]

    children = child_runs(client, parent)
    assert set(children) == set(STAGES)
    assert {child.info.status for child in children.values()} == {"FINISHED"}
    assert children["sft"].data.params["sft.max_steps"] == "4"
    for stage, child in children.items():  # each stage run names the code and data it came from
        assert child.data.tags[GIT_COMMIT_TAG] == commit, stage
        assert child.data.tags[DATA_VERSION_TAG] == tags[DATA_VERSION_TAG], stage
    ppo_tags = children["ppo"].data.tags
    assert ppo_tags["input.reward_output.run_id"] == children["reward"].info.run_id
    assert ppo_tags["input.sft_output.run_id"] == children["sft"].info.run_id
    assert {"config.ppo.sha256", "config.model.sha256", "config.distributed.sha256"} <= set(ppo_tags)
    assert children["evaluate"].data.tags["input.judge.run_id"] == children["judge-reward"].info.run_id
    ppo_history = client.get_metric_history(children["ppo"].info.run_id, "progress")
    assert max(metric.step for metric in ppo_history) > 1  # stepped, not one final value

    def artifact_paths(stage: str, path: str = "") -> set[str]:
        return {item.path for item in client.list_artifacts(children[stage].info.run_id, path)}

    assert "data_report.json" in artifact_paths("prepare-data")
    assert "plots/reward_margin_hist.png" in artifact_paths("reward", "plots")
    assert "validation_pairs.json" in artifact_paths("reward")
    assert "plots/sft_curves.png" in artifact_paths("sft", "plots") and "samples.json" in artifact_paths("sft")
    assert "samples.json" in artifact_paths("ppo") and artifact_paths("ppo", "plots")


def test_policy_challenger_is_registered_with_lineage_and_answers_chat(scenario: Scenario) -> None:
    client = MlflowClient(scenario.tracking_uri)
    first_parent, last_parent = parent_run(client, scenario.runs["A"]), parent_run(client, scenario.runs["C"])
    versions = sorted(client.search_model_versions("name = 'rlhf-policy'"), key=lambda version: int(version.version))
    assert [str(version.version) for version in versions] == ["1", "2"]  # run B added none
    first, challenger = versions[0], client.get_model_version_by_alias("rlhf-policy", CHALLENGER_ALIAS)
    assert str(challenger.version) == "2"

    assert first.tags[PIPELINE_RUN_TAG] == first_parent.info.run_id
    assert challenger.tags[PIPELINE_RUN_TAG] == last_parent.info.run_id
    assert challenger.tags[DATA_VERSION_TAG] == last_parent.data.tags[DATA_VERSION_TAG]
    assert challenger.tags[EVALUATION_STATUS_TAG] == "evaluated"
    evaluation = client.get_run(challenger.tags["evaluation.run_id"])
    assert evaluation.data.tags[STAGE_TAG] == "evaluate"
    assert evaluation.data.tags[PARENT_RUN_TAG] == last_parent.info.run_id
    assert challenger.tags["evaluation.win_rate"] == f"{evaluation.data.metrics['final.win_rate']:.6g}"
    assert challenger.tags[STAGE_RUN_TAG] == last_parent.data.tags["stage.ppo.run_id"]
    reward = client.get_model_version("rlhf-reward", challenger.tags[REWARD_VERSION_TAG])
    assert reward.tags[DATA_VERSION_TAG] == challenger.tags[DATA_VERSION_TAG]
    # The independent judge that evaluated it: registered once (run C's judge-reward stage was a cache hit).
    assert (challenger.tags[JUDGE_MODEL_TAG], challenger.tags[JUDGE_VERSION_TAG]) == ("rlhf-reward-judge", "1")
    (judge,) = client.search_model_versions("name = 'rlhf-reward-judge'")
    assert judge.tags[STAGE_RUN_TAG] == first_parent.data.tags["stage.judge-reward.run_id"]
    assert judge.tags["training_data.train_split"] == "ppo_pairs" and judge.tags["training_data.init_from"] == "base"

    mlflow.set_tracking_uri(scenario.tracking_uri)
    chat = mlflow.pyfunc.load_model(f"models:/rlhf-policy@{CHALLENGER_ALIAS}")
    reply = chat.predict({"messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 6})
    assert reply["object"] == "chat.completion" and reply["model"] == "rlhf-policy/2"
    assert isinstance(reply["choices"][0]["message"]["content"], str)
    assert "<|im_end|>" not in reply["choices"][0]["message"]["content"]
    assert 1 <= reply["usage"]["completion_tokens"] <= 6


def test_prefect_artifacts_summarise_each_stage(scenario: Scenario) -> None:
    artifacts = scenario.runs["A"].artifacts
    for stage in ("prepare-data", "sft", "reward", "ppo", "evaluate"):
        assert f"# Stage `{stage}`" in artifacts[f"{stage}-summary"]
    assert "# Evaluation: PPO policy (A) vs SFT model (B)" in artifacts["evaluate-report"]
    assert "rlhf-policy" in artifacts["register-summary"]
    samples = artifacts["ppo-samples"]
    assert "response" in (samples if isinstance(samples, str) else str(samples))
    assert "reference" in str(artifacts["sft-samples"]) and "response" in str(artifacts["sft-samples"])
    assert "reply_a" in str(artifacts["evaluate-samples"]) and "verdict" in str(artifacts["evaluate-samples"])
    for stage in ("reward", "judge-reward"):
        assert "score_rejected" in str(artifacts[f"{stage}-validation-pairs"])
    for stage in ("prepare-data", "sft", "reward", "ppo"):
        assert float(artifacts[f"{stage}-progress"]) == 100.0


def test_the_run_summary_is_an_artifact_of_the_flow_run(scenario: Scenario) -> None:
    summary = scenario.runs["A"].artifacts["pipeline-summary"]  # not a log line: `rlhf run` prints it once
    assert "run directory: " in summary and "registered: rlhf-policy version " in summary
