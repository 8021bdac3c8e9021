"""The `rlhf-pipeline` flow run in this process against a real Prefect server (fixture `prefect_api`) and
an embedded SQLite MLflow store: a failing stage fails the flow and its MLflow run, and is not retried
when retrying cannot help; a crashed training stage is retried and resumes from its checkpoint; a
deleted stage output is recomputed while unchanged stages stay cached; the parent run's params name the
data the run trained on and every stage run carries the lineage of its own inputs; the training
concurrency limit lets one training stage hold the machine at a time."""

import shutil
from pathlib import Path

import pytest
from mlflow import MlflowClient
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, LogFilter, LogFilterFlowRunId
from prefect.concurrency.sync import concurrency
from prefect.exceptions import ObjectNotFound
from prefect.logging.handlers import APILogWorker

from fixtures.pairs import write_topic_pairs
from fixtures.paths import PARAMS, ROOT, TINY
from flows.pipeline import PipelineSettings, Stage, rlhf_pipeline
from rlhf_core.config import load_config
from rlhf_core.stage_outputs import file_sha256
from rlhf_core.stages import sft as sft_stage
from tasks.execution.caching import keyed_section_hash
from tasks.execution.concurrency import ensure_training_limit, training_slot
from tasks.stages import stage_tasks as stages
from tasks.tracking.lineage import DATA_SOURCE_TAG, DATA_VERSION_TAG, GIT_COMMIT_TAG, git_state
from tasks.tracking.mlflow_runs import ERROR_TAG, PARENT_RUN_TAG, STAGE_TAG

pytestmark = pytest.mark.slow


def settings(data: Path, stages_wanted: list[Stage]) -> PipelineSettings:
    return PipelineSettings(config=[str(TINY)], data=str(data), stages=stages_wanted, params_file=str(PARAMS))


def task_runs_by_name(flow_run_id) -> dict[str, list]:
    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    grouped: dict[str, list] = {}
    for run in runs:  # task run names are "<task name>-<3 hex>"
        grouped.setdefault(run.name.rsplit("-", 1)[0], []).append(run)
    return grouped


def flow_run_messages(flow_run_id) -> set[str]:
    """The messages the flow run logged to the Prefect API (sent first: the log worker batches them)."""
    APILogWorker.drain_all(timeout=10)
    with get_client(sync_client=True) as client:
        logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
    return {log.message for log in logs}


def stage_runs(client: MlflowClient, stage: str) -> list:
    experiment = client.get_experiment_by_name("rlhf-pipeline")
    return client.search_runs(
        [experiment.experiment_id],
        filter_string=f"tags.`{STAGE_TAG}` = '{stage}'",
        order_by=["attributes.start_time ASC"],
    )


def test_invalid_data_fails_the_flow_and_its_mlflow_runs_without_retrying(
    mlflow_store: MlflowClient, tmp_path: Path
) -> None:
    data = write_topic_pairs(tmp_path / "identical.jsonl", 40, identical=True)
    state = rlhf_pipeline(settings(data, list(Stage)), return_state=True)

    assert state.is_failed()
    assert "DataValidationError" in state.message and "identical_replies=40" in state.message
    runs = task_runs_by_name(state.state_details.flow_run_id)
    assert list(runs) == ["prepare-data"]  # nothing after the failed stage ran
    (prepare,) = runs["prepare-data"]
    assert prepare.state.is_failed() and prepare.run_count == 1  # a data error is not retried

    (stage_run,) = stage_runs(mlflow_store, "prepare-data")
    assert stage_run.info.status == "FAILED"
    assert stage_run.data.tags[ERROR_TAG].startswith("DataValidationError:")
    parent = mlflow_store.get_run(stage_run.data.tags[PARENT_RUN_TAG])
    assert parent.info.status == "FAILED" and parent.data.tags[ERROR_TAG].startswith("DataValidationError:")
    assert mlflow_store.search_registered_models() == []


class CrashAtStep:
    """A metrics logger that forwards to `inner` and raises when `step` is logged: a crash mid-training."""

    def __init__(self, inner, step: int) -> None:
        self.inner, self.step = inner, step

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if step == self.step:
            raise RuntimeError(f"simulated crash at step {step}")
        self.inner.log_metrics(metrics, step)

    def log_params(self, params) -> None:
        self.inner.log_params(params)

    def close(self) -> None:
        self.inner.close()


def test_crashed_training_stage_is_retried_and_resumes_from_its_checkpoint(
    mlflow_store: MlflowClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_run_sft = sft_stage.run_sft
    attempts: list[int] = []

    def crash_once(config, data_dir, out_dir, logger=None):
        attempts.append(len(attempts) + 1)
        if len(attempts) == 1:  # tiny: checkpoint_every 2, max_steps 4; crash after the step-2 checkpoint
            return real_run_sft(config, data_dir, out_dir, logger=CrashAtStep(logger, step=3))
        return real_run_sft(config, data_dir, out_dir, logger=logger)

    monkeypatch.setattr(sft_stage, "run_sft", crash_once)
    monkeypatch.setattr(stages.sft_task, "retry_delay_seconds", 0)
    result = rlhf_pipeline(settings(write_topic_pairs(tmp_path / "pairs.jsonl", 160), [Stage.SFT]))

    assert attempts == [1, 2]
    sft_output = result.outputs["sft"]
    assert sft_output.metrics["resumed_from"] == 2.0 and sft_output.metrics["steps"] == 4.0
    assert sft_output.out_dir.parent == result.run_dir  # the retry wrote where the crashed attempt did

    failed, finished = stage_runs(mlflow_store, "sft")
    assert (failed.info.status, failed.data.tags["prefect.attempt"]) == ("FAILED", "1")
    assert failed.data.tags[ERROR_TAG] == "RuntimeError: simulated crash at step 3"
    assert (finished.info.status, finished.data.tags["prefect.attempt"]) == ("FINISHED", "2")
    assert finished.info.run_id == sft_output.mlflow_run_id
    progress = mlflow_store.get_metric_history(finished.info.run_id, "progress")
    assert max(metric.value for metric in progress) == 1.0


def test_deleted_output_is_recomputed_and_unchanged_stages_stay_cached(
    mlflow_store: MlflowClient, tmp_path: Path
) -> None:
    wanted = settings(write_topic_pairs(tmp_path / "pairs.jsonl", 160), [Stage.SFT])
    first = rlhf_pipeline(wanted)
    assert first.outputs["sft"].out_dir.parent == first.run_dir

    again = rlhf_pipeline(wanted, return_state=True)
    assert {name: run.state.name for name, (run,) in task_runs_by_name(again.state_details.flow_run_id).items()} == {
        "prepare-data": "Cached",
        "sft": "Cached",
    }
    assert again.result().outputs == first.outputs  # the cached outputs are the first run's

    shutil.rmtree(first.outputs["sft"].model_dir)
    third = rlhf_pipeline(wanted, return_state=True)
    assert {name: run.state.name for name, (run,) in task_runs_by_name(third.state_details.flow_run_id).items()} == {
        "prepare-data": "Cached",
        "sft": "Completed",
    }
    recomputed = third.result().outputs["sft"]
    assert recomputed.out_dir.parent == third.result().run_dir and recomputed.is_intact()


def test_runs_record_the_data_they_trained_on_and_each_stage_the_lineage_of_its_inputs(
    mlflow_store: MlflowClient, tmp_path: Path
) -> None:
    data = write_topic_pairs(tmp_path / "pairs.jsonl", 160)
    state = rlhf_pipeline(settings(data, [Stage.SFT]), return_state=True)
    result = state.result()
    assert flow_run_messages(state.state_details.flow_run_id) >= {"stage 1/2: prepare-data", "stage 2/2: sft"}

    parent = mlflow_store.get_run(result.mlflow_run_id)
    assert set(result.stage_minutes) == {"prepare-data", "sft"} and min(result.stage_minutes.values()) > 0
    minutes = {key: value for key, value in parent.data.metrics.items() if key.startswith("minutes.")}
    assert minutes == pytest.approx(
        {
            "minutes.prepare-data": result.stage_minutes["prepare-data"],
            "minutes.sft": result.stage_minutes["sft"],
            "minutes.total": sum(result.stage_minutes.values()),
        }
    )
    assert f"stage sft: {result.outputs['sft'].out_dir} ({result.stage_minutes['sft']:.1f} min)" in result.summary()
    assert parent.data.params["data.source"] == str(data)  # not params.yaml's Anthropic/hh-rlhf
    assert parent.data.tags[DATA_SOURCE_TAG] == str(data)
    prepare, sft = (mlflow_store.get_run(result.outputs[stage].mlflow_run_id) for stage in ("prepare-data", "sft"))
    assert prepare.data.params["data.source"] == str(data)
    commit, _ = git_state(ROOT)
    config = load_config(PARAMS, [TINY])
    for run in (prepare, sft):
        assert run.data.tags[GIT_COMMIT_TAG] == commit
        assert run.data.tags[DATA_VERSION_TAG] == file_sha256(data) == result.data.version
        assert run.data.tags["config.model.sha256"] == keyed_section_hash(config, "model")
    assert prepare.data.tags[DATA_SOURCE_TAG] == str(data)
    assert prepare.data.tags["config.data.sha256"] == keyed_section_hash(config, "data")
    assert "config.sft.sha256" not in prepare.data.tags  # only the sections a stage reads
    assert sft.data.tags["config.sft.sha256"] == keyed_section_hash(config, "sft")
    prepared = result.outputs["prepare-data"]
    assert sft.data.tags["input.data.path"] == str(prepared.out_dir)
    assert sft.data.tags["input.data.sha256"] == prepared.sha256
    assert sft.data.tags["input.data.run_id"] == prepare.info.run_id

    # The same bytes at another path are the same data: every stage is a cache hit, the params say where.
    moved = tmp_path / "elsewhere" / "pairs.jsonl"
    moved.parent.mkdir()
    shutil.copyfile(data, moved)
    again = rlhf_pipeline(settings(moved, [Stage.SFT]), return_state=True)
    assert {name: run.state.name for name, (run,) in task_runs_by_name(again.state_details.flow_run_id).items()} == {
        "prepare-data": "Cached",
        "sft": "Cached",
    }
    assert mlflow_store.get_run(again.result().mlflow_run_id).data.params["data.source"] == str(moved)


def test_training_slot_admits_one_training_stage_at_a_time(prefect_api: str) -> None:
    name = "rlhf-training-test-host"
    with training_slot("sft", name):
        with get_client(sync_client=True) as client:
            limit = client.read_global_concurrency_limit_by_name(name)
        assert (limit.limit, limit.active, limit.active_slots) == (1, True, 1)
        # A second training stage waits for the slot; here, for one second at most.
        with pytest.raises(TimeoutError), concurrency(name, occupy=1, timeout_seconds=1, strict=True):
            pass
    with get_client(sync_client=True) as client:
        assert client.read_global_concurrency_limit_by_name(name).active_slots == 0  # released
    with concurrency(name, occupy=1, timeout_seconds=30, strict=True):  # so the next stage gets it
        with get_client(sync_client=True) as client:
            assert client.read_global_concurrency_limit_by_name(name).active_slots == 1


def test_existing_training_limit_is_left_as_the_operator_set_it(prefect_api: str) -> None:
    name = "rlhf-training-operator-host"
    with get_client(sync_client=True) as client:
        with pytest.raises(ObjectNotFound):
            client.read_global_concurrency_limit_by_name(name)
        ensure_training_limit(name, slots=3)
        ensure_training_limit(name, slots=1)
        assert client.read_global_concurrency_limit_by_name(name).limit == 3
