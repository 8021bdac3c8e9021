"""The `rlhf-retrain` flow end to end: in a temporary git + DVC project whose raw data is only in the DVC remote,
it pulls the data, runs the whole tiny pipeline (evaluation included) against a real MLflow server and a real
Prefect server, registers a challenger with its independent judge reward model and ends with the promotion
flow's decision on it, judged by that registered judge without any judge configured.

Whether the tiny challenger passes the gate depends on the tiny training; the test asserts that the decision
follows from the figures (the evaluation of the registered challenger against the SFT model, and its PPO run's
KL and collapse flag) and that the registry says what the decision says.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from mlflow import MlflowClient

from flows.pipeline import PipelineSettings
from flows.retrain import RetrainResult, RetrainSettings, pipeline_settings, rlhf_retrain
from tasks.dvc_data import data_version, dvc_add, dvc_push, run_dvc
from tasks.promotion import CHAMPION_ALIAS, DECISION_TAG
from tasks.registry import CHALLENGER_ALIAS, EVALUATION_STATUS_TAG
from tasks.remote import RemoteStages

pytestmark = pytest.mark.slow

PROJECT = Path(__file__).resolve().parents[1]
PROJECT_FILES = (".dvc/config", ".dvc/.gitignore", ".dvcignore", ".gitignore", "params.yaml", "configs/tiny.yaml")
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


def git(repo: Path, *args: str) -> str:
    identity = ["-c", "user.name=rlhf-tests", "-c", "user.email=rlhf-tests@example.com"]
    return subprocess.run(["git", *identity, *args], cwd=repo, check=True, capture_output=True, text=True).stdout


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, prefect_api: str, mlflow_server: str) -> str:
    """A committed project whose data/raw.dvc names data that is in the (local) DVC remote only; the cwd."""
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q")
    for name in PROJECT_FILES:
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(PROJECT / name, repo / name)
    run_dvc(["remote", "modify", "local", "url", str(tmp_path / "dvc-remote")], repo)
    raw = repo / "data" / "raw"
    raw.mkdir(parents=True)
    rows = [
        {
            "prompt": f"Question {index}: what should I know about topic {index % 7}?",
            "chosen": f"Here is a careful answer about topic {index % 7}, number {index}.",
            "rejected": "No.",
        }
        for index in range(160)
    ]
    (raw / "pairs.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
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
    result: RetrainResult = rlhf_retrain(RetrainSettings(config=["configs/tiny.yaml"], overrides=OVERRIDES))

    pipeline = result.pipeline
    assert (Path("data/raw/pairs.jsonl")).is_file()  # pulled from the remote
    assert (pipeline.data.kind, pipeline.data.version) == ("dvc", data_version(Path("data/raw").resolve()))
    evaluation = pipeline.outputs["evaluate"]
    judged = pipeline.summary().splitlines()[-3]
    assert judged.startswith("evaluation: PPO policy (A) vs SFT model (B), judged by the reward model")
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
