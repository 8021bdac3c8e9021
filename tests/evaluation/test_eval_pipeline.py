"""The evaluate stage in the orchestration layer, against a real Prefect server and a real MLflow server (artifacts
in S3): the PPO stage records the reward model it optimised against; the evaluate task logs the evaluation to a
nested MLflow run and is a cache hit when rerun; the reward-model judge is flagged in-sample exactly when it is
the PPO run's reward model; and `rlhf eval` takes registered models by `models:/` URI.

The models are tiny (tests/fixtures/tiny_ppo.py); PPO runs for real, one iteration.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from mlflow import MlflowClient
from prefect import flow
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, FlowRunFilter, FlowRunFilterId

from fixtures.paths import PARAMS, TINY
from fixtures.stage_outputs import stage_output
from fixtures.tiny_ppo import StageInputs, save_rm_output, tiny_config, write_stage_inputs
from flows.pipeline import run_directory
from rlhf_cli.main import main
from rlhf_core.config import Config
from rlhf_core.models.tiny import load_tiny_model
from rlhf_core.stage_outputs import StageOutput, output_sha256
from rlhf_core.stages.evaluate import judge_in_sample
from rlhf_core.stages.ppo import REWARD_RECORD_FILE, run_ppo
from tasks.evaluation.evaluate_task import JudgeSpec, evaluate_task
from tasks.execution.caching import with_cache_dir
from tasks.registry.registered_models import CHALLENGER_ALIAS, REWARD_VERSION_TAG, register
from tasks.stages.stage_runs import StageContext
from tasks.tracking.lineage import flow_run_tags
from tasks.tracking.mlflow_runs import PARENT_RUN_TAG, STAGE_TAG, close_run, open_pipeline_run

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

EXPERIMENT = "eval-pipeline-tests"
POLICY_NAME = "evalpipe-policy"
REWARD_NAME = "evalpipe-reward"
SETTINGS = (f"tracking.experiment={EXPERIMENT}", "ppo.steps=1", "evaluation.max_prompts=6")


@pytest.fixture(scope="module")
def outputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, StageOutput]:
    """Prepared data, SFT and reward-model outputs, a second reward model, and a real (one-iteration) PPO run."""
    root = tmp_path_factory.mktemp("eval-pipeline")
    inputs: StageInputs = write_stage_inputs(root)
    save_rm_output(root / "other-reward", load_tiny_model()[1], seed=7)
    run_ppo(tiny_config(*SETTINGS), inputs.data_dir, inputs.sft_dir, inputs.rm_dir, root / "ppo")
    return {
        "data": stage_output("prepare-data", inputs.data_dir, with_model=False),
        "sft": stage_output("sft", inputs.sft_dir),
        "reward": stage_output("reward", inputs.rm_dir),
        "other-reward": stage_output("reward", root / "other-reward"),
        "ppo": stage_output("ppo", root / "ppo"),
    }


@flow(name="evaluate-under-test")
def evaluate_flow(config: Config, outputs: dict[str, StageOutput], judge_rm: str, runs_dir: Path) -> StageOutput:
    """The evaluate task as flows/pipeline.py runs it: PPO (A) vs SFT (B), in a parent MLflow run."""
    tracking = open_pipeline_run(config, runs_dir, run_name="evaluate-test", tags=flow_run_tags())
    context = StageContext(run_dir=run_directory(runs_dir), cache_dir=runs_dir / ".cache", tracking=tracking)
    output = with_cache_dir(evaluate_task, context.cache_dir)(
        config,
        outputs["data"],
        outputs["ppo"],
        outputs["sft"],
        JudgeSpec(kind="rm", reward=outputs[judge_rm]),
        context,
        names=("PPO policy", "SFT model"),
    )
    close_run(tracking.client(), tracking.parent_run_id)
    return output


def task_states(flow_run_id) -> dict[str, str]:
    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    return {run.name.rsplit("-", 1)[0]: run.state.name for run in runs}


def artifacts_of(flow_run_id) -> dict[str, object]:
    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
        )
    return {artifact.key: artifact.data for artifact in artifacts if artifact.key}


@pytest.fixture(scope="module")
def runs_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("runs")


@pytest.fixture
def tracking(mlflow_server: str, prefect_api: str, monkeypatch: pytest.MonkeyPatch) -> MlflowClient:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    return MlflowClient(mlflow_server)


def test_ppo_records_the_reward_model_it_optimised_against(outputs: dict[str, StageOutput]) -> None:
    record = json.loads((outputs["ppo"].out_dir / REWARD_RECORD_FILE).read_text())
    assert record["path"] == str(outputs["reward"].out_dir.resolve())
    assert record["sha256"] == outputs["reward"].sha256  # the registry's content hash of the reward model
    assert judge_in_sample(outputs["ppo"].out_dir, outputs["reward"].out_dir, claimed=None) is True
    assert judge_in_sample(outputs["ppo"].out_dir, outputs["other-reward"].out_dir, claimed=None) is False
    with pytest.raises(ValueError, match="cannot judge as an independent reward model"):
        judge_in_sample(outputs["ppo"].out_dir, outputs["reward"].out_dir, claimed=False)
    # A policy that does not say which reward model trained it: the caller's word, else in-sample.
    assert judge_in_sample(outputs["sft"].out_dir, outputs["reward"].out_dir, claimed=None) is True
    assert judge_in_sample(outputs["sft"].out_dir, outputs["reward"].out_dir, claimed=False) is False


def test_evaluate_task_logs_the_evaluation_and_a_rerun_is_a_cache_hit(
    outputs: dict[str, StageOutput], tracking: MlflowClient, runs_dir: Path, tmp_path: Path
) -> None:
    config = tiny_config(*SETTINGS)
    state = evaluate_flow(config, outputs, "reward", runs_dir, return_state=True)
    assert state.is_completed(), state.message
    output: StageOutput = state.result()
    assert task_states(state.state_details.flow_run_id) == {"evaluate": "Completed"}

    verdicts = [json.loads(line) for line in (output.out_dir / "verdicts.jsonl").read_text().splitlines()]
    run = tracking.get_run(output.mlflow_run_id)
    assert run.data.tags[STAGE_TAG] == "evaluate" and PARENT_RUN_TAG in run.data.tags
    metrics = run.data.metrics
    valid = [row["verdict"] for row in verdicts if row["verdict"] != "invalid"]
    assert metrics["final.win_rate"] == pytest.approx(valid.count("A") / len(valid))
    assert metrics["final.lose_rate"] == pytest.approx(valid.count("B") / len(valid))
    assert (
        metrics["final.win_minus_loss_low"] <= metrics["final.win_minus_loss"] <= metrics["final.win_minus_loss_high"]
    )
    differences = [row["score_a"] - row["score_b"] for row in verdicts]  # the judge's scores of each pair
    assert metrics["final.score_diff_mean"] == pytest.approx(sum(differences) / len(differences))
    assert metrics["final.score_diff_low"] <= metrics["final.score_diff_mean"] <= metrics["final.score_diff_high"]
    for name in ("win_rate_low", "win_rate_high", "mean_tokens_a", "mean_tokens_b", "alignment_tax"):
        assert metrics[f"final.{name}"] == pytest.approx(output.metrics[name])
    assert metrics["final.judge_in_sample"] == 1.0  # judged by the PPO run's own reward model
    assert run.data.params["judge"] == "rm"

    artifacts = {item.path for item in tracking.list_artifacts(output.mlflow_run_id)}
    assert {"report.md", "report.json", "metrics.json", "pairs.json"} <= artifacts
    assert {item.path for item in tracking.list_artifacts(output.mlflow_run_id, "plots")} == {"plots/win_rate.png"}
    table = json.loads(Path(tracking.download_artifacts(output.mlflow_run_id, "pairs.json", str(tmp_path))).read_text())
    rows = [dict(zip(table["columns"], row)) for row in table["data"]]
    assert [(row["prompt_id"], row["verdict"]) for row in rows] == [
        (row["prompt_id"], row["verdict"]) for row in verdicts
    ]
    # MLflow's table artifact keeps 10 decimals of each float
    assert [row["margin"] for row in rows] == pytest.approx([row["margin"] for row in verdicts], abs=1e-9)
    report_md = (output.out_dir / "report.md").read_text()
    assert "# Evaluation: PPO policy (A) vs SFT model (B)" in report_md and "In-sample judge" in report_md
    assert artifacts_of(state.state_details.flow_run_id)["evaluate-report"] == report_md

    rerun = evaluate_flow(config, outputs, "reward", runs_dir, return_state=True)
    assert task_states(rerun.state_details.flow_run_id) == {"evaluate": "Cached"}
    assert rerun.result() == output


def test_an_independent_reward_model_is_not_flagged_in_sample(
    outputs: dict[str, StageOutput], tracking: MlflowClient, runs_dir: Path
) -> None:
    output = evaluate_flow(tiny_config(*SETTINGS), outputs, "other-reward", runs_dir)
    assert output.metrics["judge_in_sample"] == 0.0
    assert tracking.get_run(output.mlflow_run_id).data.metrics["final.judge_in_sample"] == 0.0
    assert "In-sample judge" not in (output.out_dir / "report.md").read_text()


def test_rlhf_eval_takes_registered_models_by_uri(
    outputs: dict[str, StageOutput],
    tracking: MlflowClient,
    mlflow_server: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    experiment = tracking.get_experiment_by_name(EXPERIMENT) or tracking.get_experiment(
        tracking.create_experiment(EXPERIMENT)
    )
    run_id = tracking.create_run(experiment.experiment_id).info.run_id
    reward = register(tracking, mlflow_server, run_id, REWARD_NAME, outputs["reward"], {}, alias=None)
    policy_tags = {REWARD_VERSION_TAG: reward.version}
    register(tracking, mlflow_server, run_id, POLICY_NAME, outputs["ppo"], policy_tags, alias=CHALLENGER_ALIAS)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("RLHF_CACHE_DIR", str(tmp_path / "cache"))  # downloads go to the model cache

    def rlhf_eval(*args: str) -> tuple[int, str, str]:
        common = ["-c", str(TINY), "--params", str(PARAMS)]
        common += ["-s", f"tracking.reward_model_name={REWARD_NAME}", "-s", "evaluation.max_prompts=6"]
        common += ["--data-dir", str(outputs["data"].out_dir)]
        monkeypatch.setattr(sys, "argv", ["rlhf", "eval", *args, *common])
        with pytest.raises(SystemExit) as exit_info:
            main()
        captured = capsys.readouterr()
        return exit_info.value.code or 0, captured.out, captured.err

    uri = f"models:/{POLICY_NAME}@{CHALLENGER_ALIAS}"
    status, stdout, stderr = rlhf_eval(
        "--a", uri, "--b", str(outputs["sft"].out_dir), "--rm-dir", f"models:/{REWARD_NAME}/{reward.version}",
        "--out", "eval-registry",
    )  # fmt: skip
    assert status == 0, stderr
    assert f"# Evaluation: {uri} (A) vs" in stdout
    assert "In-sample judge" in stdout  # the registry says which reward model trained the policy
    assert not (tmp_path / "artifacts").exists()  # nothing downloaded into the working tree
    (policy,) = (tmp_path / "cache" / "registry").glob(f"{POLICY_NAME}-v1-*")
    assert json.loads((policy / REWARD_RECORD_FILE).read_text())["sha256"] == outputs["reward"].sha256
    assert (policy / "config.json").is_file() and (policy / "tokenizer_config.json").is_file()
    (reward_dir,) = (tmp_path / "cache" / "registry").glob(f"{REWARD_NAME}-v{reward.version}-*")
    assert output_sha256(reward_dir, reward_dir) == outputs["reward"].sha256  # the very reward model
    metrics = json.loads((tmp_path / "eval-registry" / "metrics.json").read_text())
    assert metrics["judge_in_sample"] == 1.0 and metrics["valid_pairs"] >= 1
