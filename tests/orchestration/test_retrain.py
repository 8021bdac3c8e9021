"""The `rlhf-retrain` flow end to end: in a temporary git + DVC project whose raw data is only in the DVC remote,
it pulls the data, runs the whole tiny pipeline (evaluation included) against a real MLflow server and a real
Prefect server, registers a challenger with its independent judge reward model and ends with the promotion
flow's decision on it, judged by that registered judge without any judge configured.

Whether the tiny challenger passes the gate depends on the tiny training; the test asserts that the decision
follows from the figures (the evaluation of the registered challenger against the SFT model, and its PPO run's
KL and collapse flag) and that the registry says what the decision says.

Event-driven retraining: `rlhf data add` in that project emits `rlhf.data.pushed`, and the real server's
automation for the deployment's trigger creates a flow run with the new version as its parameter; a run
asked for a version the checkout does not pin stops before pulling anything.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import replace
from pathlib import Path
from uuid import UUID

import pytest
import typer
from mlflow import MlflowClient
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId, FlowFilter, FlowFilterName
from prefect.client.schemas.objects import FlowRun
from typer.testing import CliRunner

from fixtures.pairs import write_topic_pairs
from fixtures.project_repos import PROJECT_FILES, copy_project_files, git
from flows.deployments import DEPLOYMENTS, runner_deployment
from flows.pipeline import PipelineSettings
from flows.retrain import DataVersionMismatchError, RetrainResult, RetrainSettings, pipeline_settings, rlhf_retrain
from rlhf_cli.data_commands import data_app
from tasks.data.data_events import DATA_PUSHED_EVENT
from tasks.data.dvc_data import data_version, dvc_add, dvc_pull, dvc_push, run_dvc
from tasks.promotion.promote_tasks import CHAMPION_ALIAS, DECISION_TAG
from tasks.registry.registered_models import CHALLENGER_ALIAS, EVALUATION_STATUS_TAG
from tasks.stages.remote import RemoteStages

pytestmark = pytest.mark.slow

POLICY = "retrain-policy"
OVERRIDES = [
    f"tracking.policy_model_name={POLICY}",
    "tracking.reward_model_name=retrain-reward",
    "tracking.experiment=retrain-tests",
    "sft.max_steps=2",
    "reward.max_steps=2",
    "ppo.steps=1",
    "evaluation.max_prompts=6",
]
TRIGGERED_RUN_DEADLINE_S = 60.0


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, prefect_api: str, mlflow_server: str) -> str:
    """A committed project whose data/raw.dvc names data that is in the (local) DVC remote only; the cwd."""
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q")
    copy_project_files(repo, PROJECT_FILES)
    run_dvc(["remote", "modify", "local", "url", str(tmp_path / "dvc-remote")], repo)
    raw = repo / "data" / "raw"
    raw.mkdir(parents=True)
    write_topic_pairs(raw / "pairs.jsonl", 160)
    dvc_add(raw)
    dvc_push(raw)
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "project and data")
    shutil.rmtree(raw)
    shutil.rmtree(repo / ".dvc" / "cache")  # only the remote has the data now
    monkeypatch.chdir(repo)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    return mlflow_server


def test_retrain_pulls_the_data_runs_the_pipeline_and_ends_with_a_promotion_decision(project: str) -> None:
    pinned = data_version(Path("data/raw"))  # the version a new-data event would name
    settings = RetrainSettings(config=["configs/tiny.yaml"], overrides=OVERRIDES, data_version=pinned)
    result: RetrainResult = rlhf_retrain(settings)

    pipeline = result.pipeline
    assert (Path("data/raw/pairs.jsonl")).is_file()  # pulled from the remote
    assert (pipeline.data.kind, pipeline.data.version) == ("dvc", data_version(Path("data/raw").resolve()))
    evaluation = pipeline.outputs["evaluate"]
    (judged,) = [line for line in pipeline.summary().splitlines() if line.startswith("evaluation:")]
    assert judged.startswith(
        "evaluation: PPO policy (A) vs SFT model (B), judged by the independent judge reward model"
    )
    assert "IN-SAMPLE" not in judged  # the independent judge reward model, the default

    client = MlflowClient(project)
    (policy,) = [version for version in pipeline.registered if version.name == POLICY]
    tags = client.get_model_version(POLICY, policy.version).tags
    assert tags[EVALUATION_STATUS_TAG] == "evaluated" and tags["evaluation.run_id"] == evaluation.mlflow_run_id
    assert tags["evaluation.win_minus_loss_low"] == f"{evaluation.metrics['win_minus_loss_low']:.6g}"
    assert tags["lineage.sft.out_dir"] == str(pipeline.outputs["sft"].out_dir)
    assert client.get_registered_model(POLICY).aliases[CHALLENGER_ALIAS] == policy.version

    promotion = result.promotion
    assert promotion.challenger == policy.version and promotion.champion_before is None
    (judge,) = [version for version in pipeline.registered if version.name == "retrain-reward-judge"]
    assert promotion.judge is not None and promotion.judge.source == "registered"
    assert promotion.judge.reference == f"models:/retrain-reward-judge/{judge.version}"
    assert promotion.judge_in_sample is False
    assert promotion.baseline == f"SFT model of version {policy.version} ({pipeline.outputs['sft'].out_dir})"
    checks = {check.name: check for check in promotion.checks}
    promotion_run = client.get_run(promotion.evaluation_run_id)
    assert checks["win_minus_loss_low"].value == promotion_run.data.metrics["final.win_minus_loss_low"]
    # The registered challenger is the trained policy: its evaluation against SFT gives the same figures.
    assert checks["win_minus_loss_low"].value == pytest.approx(evaluation.metrics["win_minus_loss_low"])
    # It is the pipeline's very evaluation, read back: the same policy, SFT, data and judge by content.
    assert promotion.evaluation_run_id == evaluation.mlflow_run_id
    assert promotion.evaluation_note is not None and promotion.evaluation_note.startswith("reused the evaluation")
    assert checks["kl_to_reference"].value == pipeline.outputs["ppo"].metrics["val/kl_best"]
    assert checks["no_collapse"].value == pipeline.outputs["ppo"].metrics["guard_stopped"]

    passed = all(check.passed for check in promotion.checks)
    aliases = client.get_registered_model(POLICY).aliases
    if passed:
        assert promotion.decision == "promoted" and aliases[CHAMPION_ALIAS] == policy.version
        assert client.get_model_version(POLICY, policy.version).tags[DECISION_TAG] == "promoted"
    else:
        assert promotion.decision == "rejected" and CHAMPION_ALIAS not in aliases
        assert DECISION_TAG not in client.get_model_version(POLICY, policy.version).tags
    assert result.summary().endswith(f"promotion: {promotion.decision}: {promotion.message}")


def test_retrain_hands_its_settings_and_remote_stages_to_the_pipeline() -> None:
    remote = RemoteStages(stages=["sft", "ppo"], store="s3://rlhf-data/handover")
    settings = RetrainSettings(config=["configs/tiny.yaml"], overrides=["seed=7"], runs_dir="nightly", remote=remote)

    pipeline = pipeline_settings(settings, "/data/raw")

    assert pipeline.remote == remote and pipeline.data == "/data/raw"
    assert (pipeline.config, pipeline.overrides, pipeline.runs_dir) == (["configs/tiny.yaml"], ["seed=7"], "nightly")
    assert pipeline.stages == PipelineSettings().stages  # every stage


def test_a_version_the_checkout_does_not_pin_stops_the_retrain_before_the_pull(project: str) -> None:
    other = "0123456789abcdef0123456789abcdef.dir"
    with pytest.raises(DataVersionMismatchError) as stopped:
        rlhf_retrain(RetrainSettings(config=["configs/tiny.yaml"], overrides=OVERRIDES, data_version=other))
    message = str(stopped.value)
    assert f"asked to train on data version {other}" in message and data_version(Path("data/raw")) in message
    assert "git pull" in message
    assert not Path("data/raw").exists()  # nothing pulled, nothing trained


def wait_for_flow_run(deployment_id: UUID, deadline_s: float) -> FlowRun:
    """The first flow run of the deployment, polled for until `deadline_s` has passed."""
    deadline = time.monotonic() + deadline_s
    deployments = DeploymentFilter(id=DeploymentFilterId(any_=[deployment_id]))
    with get_client(sync_client=True) as client:
        while True:
            runs = client.read_flow_runs(deployment_filter=deployments)
            if runs:
                return runs[0]
            if time.monotonic() > deadline:
                raise AssertionError(f"no flow run of deployment {deployment_id} within {deadline_s:.0f} s")
            time.sleep(0.5)


def delete_triggered_runs(version: str) -> None:
    """Delete every rlhf-retrain flow run the test's event created (an earlier module may have registered
    the real deployment, with the same trigger, on this session's server)."""
    with get_client(sync_client=True) as client:
        for run in client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["rlhf-retrain"]))):
            if run.parameters.get("settings", {}).get("data_version") == version:
                client.delete_flow_run(run.id)


def test_rlhf_data_add_starts_the_retrain_deployment_on_the_new_version(
    project: str, prefect_api: str, tmp_path: Path
) -> None:
    dvc_pull(Path("data/raw"))  # a clone adds on top of the pinned version
    retrain = next(spec for spec in DEPLOYMENTS if spec.name == "rlhf-retrain")
    # The deployment as `rlhf serve` registers it, trigger included, under a name no other test serves.
    deployment_id = runner_deployment(replace(retrain, name="rlhf-retrain-event-test", cron=None)).apply()
    new = tmp_path / "new-pairs.jsonl"
    rows = [{"prompt": f"New question {index}?", "chosen": f"Answer {index}.", "rejected": "No."} for index in range(8)]
    new.write_text("".join(json.dumps(row) + "\n" for row in rows))
    app = typer.Typer()
    app.add_typer(data_app, name="data")
    version = ""
    try:
        added = CliRunner().invoke(app, ["data", "add", str(new), "--config", "configs/tiny.yaml"])
        assert added.exit_code == 0, added.output
        version = data_version(Path("data/raw"))
        assert f"sent event {DATA_PUSHED_EVENT} to the Prefect API at {prefect_api}" in added.output

        triggered = wait_for_flow_run(deployment_id, TRIGGERED_RUN_DEADLINE_S)

        assert triggered.parameters == {"settings": {"data": "data/raw", "data_version": version}}
        assert rlhf_retrain.validate_parameters(triggered.parameters)["settings"].data_version == version
    finally:
        with get_client(sync_client=True) as client:
            client.delete_resource_owned_automations(f"prefect.deployment.{deployment_id}")
            client.delete_deployment(deployment_id)
        delete_triggered_runs(version)
