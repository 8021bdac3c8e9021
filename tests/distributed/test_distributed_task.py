"""The `sft` Prefect task with `distributed.num_processes: 2`: launched, streamed, tracked, and failed.

The pipeline flow runs in this process against a real Prefect server (fixture `prefect_api`) and an
embedded SQLite MLflow store, as in test_orchestration_flow.py. With two processes the task starts the
stage under the `deepspeed` launcher: both ranks' log lines must reach the task's Prefect log, rank 0's
stepped metrics its MLflow run, and a stage that fails in the ranks must fail the task with the error
of a named rank.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from mlflow import MlflowClient
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, LogFilter, LogFilterFlowRunId

from fixtures.pairs import write_topic_pairs
from fixtures.paths import PARAMS, TINY
from fixtures.servers import free_port
from flows.pipeline import PipelineSettings, Stage, rlhf_pipeline
from tasks.tracking.mlflow_runs import STAGE_TAG

pytestmark = pytest.mark.slow

STEPS = 2


@pytest.fixture
def project(mlflow_store: MlflowClient, monkeypatch: pytest.MonkeyPatch) -> MlflowClient:
    """The shared `mlflow_store`, and one OpenMP thread in each rank the task launches (they inherit it)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    return mlflow_store


def two_rank_sft(data: Path, *overrides: str) -> PipelineSettings:
    return PipelineSettings(
        config=[str(TINY)],
        overrides=[
            "distributed.num_processes=2",
            f"distributed.master_port={free_port()}",
            f"sft.max_steps={STEPS}",
            "sft.micro_batch_size=2",
            "sft.grad_accum_steps=1",
            *overrides,
        ],
        data=str(data),
        stages=[Stage.PREPARE_DATA, Stage.SFT],
        params_file=str(PARAMS),
    )


def flow_log_messages(flow_run_id) -> list[str]:
    with get_client(sync_client=True) as client:
        logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
    return [log.message for log in logs]


def test_two_rank_sft_streams_both_ranks_and_tracks_rank_0s_metrics(project: MlflowClient, tmp_path: Path) -> None:
    state = rlhf_pipeline(two_rank_sft(write_topic_pairs(tmp_path / "pairs.jsonl", 60)), return_state=True)
    assert state.is_completed(), state.message
    messages = flow_log_messages(state.state_details.flow_run_id)
    assert any(message.startswith("[rank 0] ") and "rank 0 of 2" in message for message in messages)
    assert any(message.startswith("[rank 1] ") and "rank 1 of 2" in message for message in messages)
    assert any(message.startswith("[launcher] ") for message in messages)

    experiment = project.get_experiment_by_name("rlhf-pipeline")
    (sft_run,) = project.search_runs([experiment.experiment_id], filter_string=f"tags.`{STAGE_TAG}` = 'sft'")
    assert sft_run.info.status == "FINISHED"
    losses = project.get_metric_history(sft_run.info.run_id, "loss")
    assert sorted(metric.step for metric in losses) == list(range(1, STEPS + 1))


def test_a_failing_rank_fails_the_task_with_its_error(project: MlflowClient, tmp_path: Path) -> None:
    data = write_topic_pairs(tmp_path / "pairs.jsonl", 60)
    # Valid as configuration, impossible for the 2-layer tiny model: every rank raises while freezing.
    state = rlhf_pipeline(two_rank_sft(data, "sft.trainable_top_layers=5"), return_state=True)
    assert state.is_failed()
    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[state.state_details.flow_run_id]))
        )
    (sft,) = [run for run in runs if run.name.startswith("sft-")]
    assert sft.state.is_failed()
    assert "of 2 failed: ValueError: n must be -1, None or in [0, 2]" in state.message
