"""The pipeline's stage graph (flows/pipeline.py `run_stages`): the judge reward model trains beside SFT and
the reward model, on its share of the cores; a failure on either side fails the run with that stage's
error and stops the other side. The stage functions are stubs that record when they start and end and
wait for each other through events (no clock is read), so the order of events proves the overlap."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from mlflow import MlflowClient

import flows.pipeline as pipeline
from fixtures.pairs import write_topic_pairs
from fixtures.paths import PARAMS, TINY
from fixtures.tiny_ppo import tiny_config
from flows.pipeline import PipelineSettings, Stage, rlhf_pipeline, run_stages, stages_in_order, stages_to_run
from flows.stage_clock import StageClock
from rlhf_core.distributed.launcher import LaunchStoppedError
from rlhf_core.stage_outputs import StageOutput
from tasks.execution.core_share import CORE_SHARE
from tasks.stages.remote import RemoteStages
from tasks.stages.stage_runs import StageContext
from tasks.stages.stage_tasks import reward_task, sft_task
from tasks.tracking.mlflow_runs import TrackingTarget

WAIT_SECONDS = 30.0  # what a stub waits for the other side at most (a bound, never a measurement)


class Stubs:
    """Stub stages: `events` in the order they happened, `shares` the threads each saw, `gates` to hold them."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self.lock = threading.Lock()
        self.started = {stage: threading.Event() for stage in ("prepare-data", "sft", "reward", "judge-reward")}
        self.threads: dict[str, int] = {}
        self.stop_seen: bool | None = None

    def record(self, stage: str, event: str) -> None:
        with self.lock:
            self.events.append(f"{stage} {event}")
        if event == "start":
            self.started[stage].set()
            share = CORE_SHARE.get()
            launched = stage == "judge-reward" and share is not None  # its process's threads
            self.threads[stage] = int(share.launch_env(1)["OMP_NUM_THREADS"]) if launched else torch.get_num_threads()

    def stage(self, name: str, body: Callable[[], None] = lambda: None) -> StageOutput:
        self.record(name, "start")
        body()
        self.record(name, "end")
        return StageOutput(stage=name, out_dir=Path(name), sha256=name)


@pytest.fixture
def stubs(monkeypatch: pytest.MonkeyPatch) -> Stubs:
    recorded = Stubs()
    prepare = lambda *args, **kwargs: recorded.stage("prepare-data")  # noqa: E731 - the only cached task called
    monkeypatch.setattr(pipeline, "with_cache_dir", lambda task, cache_dir: prepare)
    return recorded


def main_line(stubs: Stubs, sft: Callable[[], None], reward: Callable[[], None] = lambda: None):
    """A `run_training_stage` stand-in: `sft` and `reward` run as the bodies of those stages."""
    bodies = {sft_task: ("sft", sft), reward_task: ("reward", reward)}

    def run_training_stage(task: object, *args: object, **kwargs: object) -> StageOutput:
        name, body = bodies[task]
        return stubs.stage(name, body)

    return run_training_stage


def run(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, stubs: Stubs, sft, judge, reward=lambda: None) -> StageClock:
    """`run_stages` up to the reward model and the judge (the stages `--stage reward --stage judge-reward` asks for)."""
    monkeypatch.setattr(pipeline, "run_training_stage", main_line(stubs, sft, reward))
    monkeypatch.setattr(pipeline, "train_judge_reward", lambda *args: stubs.stage("judge-reward", judge))
    config = tiny_config()
    selected = stages_to_run([Stage.REWARD, Stage.JUDGE_REWARD])
    clock = StageClock([stage.value for stage in stages_in_order(selected, config)], logging.getLogger("graph"))
    tracking = TrackingTarget(tracking_uri="unused", experiment_id="0", parent_run_id="unused")
    context = StageContext(run_dir=tmp_path, cache_dir=tmp_path / ".cache", tracking=tracking)
    run_stages(config, None, selected, context, context.cache_dir, {}, RemoteStages(), clock)  # type: ignore[arg-type]
    return clock


def test_the_judge_reward_model_starts_before_sft_ends_on_its_share_of_the_cores(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, stubs: Stubs
) -> None:
    threads = torch.get_num_threads()

    def sft() -> None:  # ends only once the judge has started
        stubs.started["judge-reward"].wait(WAIT_SECONDS)

    def judge() -> None:  # ends only once the reward model has started
        stubs.started["reward"].wait(WAIT_SECONDS)

    clock = run(monkeypatch, tmp_path, stubs, sft=sft, judge=judge)
    events = stubs.events
    assert events.index("judge-reward start") < events.index("sft end")
    assert events.index("reward start") < events.index("judge-reward end")
    assert events.index("sft end") < events.index("reward start")  # the main line keeps its order
    assert set(clock.minutes) == {"prepare-data", "sft", "reward", "judge-reward"}
    expected = (max(1, threads - threads // 2), max(1, threads // 2))
    assert (stubs.threads["sft"], stubs.threads["judge-reward"]) == expected
    assert torch.get_num_threads() == threads  # given back after the overlap


def test_a_main_line_stage_that_starts_after_the_judge_ended_has_every_thread(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, stubs: Stubs
) -> None:
    def sft() -> None:  # ends only once the judge's thread has ended
        stubs.started["judge-reward"].wait(WAIT_SECONDS)
        for thread in threading.enumerate():
            if thread.name == "stage-judge-reward":
                thread.join(WAIT_SECONDS)

    def judge() -> None:  # ends once SFT has started
        stubs.started["sft"].wait(WAIT_SECONDS)

    run(monkeypatch, tmp_path, stubs, sft=sft, judge=judge)
    threads = torch.get_num_threads()
    assert (stubs.threads["sft"], stubs.threads["reward"]) == (max(1, threads - threads // 2), threads)


def test_a_failing_judge_fails_the_run_with_its_error_before_the_next_main_line_stage(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, stubs: Stubs
) -> None:
    judge_failed = threading.Event()

    def judge() -> None:
        judge_failed.set()
        raise RuntimeError("judge reward model broke")

    def sft() -> None:  # SFT trains in the flow's process: it ends before the failure can be raised
        judge_failed.wait(WAIT_SECONDS)

    with pytest.raises(RuntimeError, match="judge reward model broke"):
        run(monkeypatch, tmp_path, stubs, sft=sft, judge=judge)
    assert "reward start" not in stubs.events


def test_a_failing_main_line_stage_fails_the_run_with_its_error_and_stops_the_judge(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, stubs: Stubs
) -> None:
    def judge() -> None:  # as a launched judge does: its launch stops when the share's stop is set
        share = CORE_SHARE.get()
        assert share is not None
        stubs.stop_seen = share.stop.wait(WAIT_SECONDS)
        raise LaunchStoppedError("stopped on request")

    def sft() -> None:
        stubs.started["judge-reward"].wait(WAIT_SECONDS)
        raise RuntimeError("sft broke")

    with pytest.raises(RuntimeError, match="sft broke"):
        run(monkeypatch, tmp_path, stubs, sft=sft, judge=judge)
    assert stubs.stop_seen is True
    assert "judge-reward end" not in stubs.events  # it was stopped, not finished
    assert not any(thread.name == "stage-judge-reward" for thread in threading.enumerate())  # waited for


@pytest.mark.slow
def test_a_tiny_run_trains_the_judge_in_its_own_process_beside_sft_and_the_reward_model(
    mlflow_store: MlflowClient, tmp_path: Path
) -> None:
    """The real stages on Prefect's and MLflow's test stores: the judge's Prefect task runs in the thread beside
    the main line, trains in a launched process (its launch log) and every stage's minutes reach the summary
    and the parent run, whose total is the wall clock of the run (no more than the sum, as stages overlap)."""
    data = write_topic_pairs(tmp_path / "pairs.jsonl", 160)
    wanted = PipelineSettings(
        config=[str(TINY)], data=str(data), stages=[Stage.REWARD, Stage.JUDGE_REWARD], params_file=str(PARAMS)
    )
    result = rlhf_pipeline(wanted)
    assert set(result.outputs) == set(result.stage_minutes) == {"prepare-data", "sft", "reward", "judge-reward"}
    judge = result.outputs["judge-reward"]
    assert judge.is_intact() and list((judge.out_dir / "logs").glob("launch-*/launcher.log"))
    assert not (result.outputs["sft"].out_dir / "logs").exists()  # the main line trains in the flow's process
    assert result.total_minutes is not None and result.total_minutes <= sum(result.stage_minutes.values())
    metrics = mlflow_store.get_run(result.mlflow_run_id).data.metrics
    assert metrics["minutes.total"] == pytest.approx(result.total_minutes)
    assert metrics["minutes.judge-reward"] == pytest.approx(result.stage_minutes["judge-reward"])
    assert f"stages took {result.total_minutes:.1f} min in all (wall clock)" in result.summary()
