"""The MLflow tracking server and the Prefect API stopped in the middle of `rlhf run` and started again on the
same port and store (tasks/services/service_outages.py).

- Each away for OUTAGE_S in the middle of a training stage of one whole run (the issue says a minute; 20 s
  shows the same behaviour, as both clients wait minutes): the run waits and goes on, ends with the outputs
  of every stage complete, one registered version per model, every MLflow run FINISHED and the flow run
  Completed.
- The tracking server away for longer than its client waits (that wait shortened from about 4 minutes to a
  second or two by MLflow's own retry settings, so that the same outage outlasts it): the run stops with one
  line naming the server and its URL, the interrupted stage's output incomplete (no metrics.json), and the
  same command run again, the server back, resumes it, reuses the finished stages unchanged (hashes) and
  registers one version per model.
Real servers, started and stopped here (tests/fixtures/servers.py), and `rlhf run` as its own process.
Without servers: which errors are a lost service, and what that changes (the line, no retry, no close).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from mlflow import MlflowClient

from fixtures.commands import RLHF_COMMAND, summary_lines
from fixtures.kill_resume import start_until_checkpoint
from fixtures.pairs import write_topic_pairs
from fixtures.paths import PARAMS, ROOT, TINY
from fixtures.servers import free_port, prefect_settings_server, start_mlflow_server, start_prefect_server, stop_server
from rlhf_core.layout import METRICS_FILE
from rlhf_core.stage_outputs import directory_sha256
from rlhf_core.training.checkpoint import complete_checkpoints
from tasks.services.service_outages import (
    FILE_LEASE_STORAGE,
    MEMORY_LEASE_STORAGE,
    lost_service_line,
    memory_leases_warning,
)
from tasks.tracking.mlflow_runs import close_run

OUTAGE_S = 20
SFT_STEPS = 40  # SFT long enough to be mid-stage through a server's outage and its restart
START_DEADLINE_S = 600  # guards for a hung run, not measurements
RUN_DEADLINE_S = 900
SHORTER = ["-s", "reward.max_steps=2", "-s", "ppo.steps=1", "-s", "evaluation.max_prompts=4"]
SHORT_MLFLOW_WAIT = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1"}


class Services:
    """A real MLflow tracking server and Prefect API under `root`, each restartable on its port and store."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.env = {key: value for key, value in os.environ.items() if not key.startswith(("PREFECT_", "MLFLOW_"))}
        (root / "mlflow").mkdir(parents=True)
        (root / "prefect").mkdir()
        self.mlflow, self.tracking_uri = start_mlflow_server(*self.mlflow_args())
        self.prefect, self.api_url = start_prefect_server(root / "prefect")

    def mlflow_args(self) -> tuple[Path, str, dict[str, str]]:
        return self.root / "mlflow", (self.root / "mlflow" / "artifacts").as_uri(), self.env

    def stop_mlflow(self) -> None:
        stop_server(self.mlflow)

    def start_mlflow(self) -> None:
        self.mlflow, _ = start_mlflow_server(*self.mlflow_args(), port=port_of(self.tracking_uri))

    def stop_prefect(self) -> None:
        stop_server(self.prefect)

    def start_prefect(self) -> None:
        self.prefect, _ = start_prefect_server(self.root / "prefect", port=port_of(self.api_url))

    def run_env(self, project: Path) -> dict[str, str]:
        """`rlhf run`'s environment: both services configured, a PREFECT_HOME of its own."""
        return self.env | {
            "PREFECT_API_URL": self.api_url,
            "MLFLOW_TRACKING_URI": self.tracking_uri,
            "PREFECT_HOME": str(project / "prefect-home"),
            "PYTHONPATH": str(ROOT),
        }

    def close(self) -> None:
        stop_server(self.mlflow)
        stop_server(self.prefect)


def port_of(url: str) -> int:
    return int(url.split(":")[2].split("/")[0])


@pytest.fixture
def services(tmp_path: Path) -> Iterator[Services]:
    started = Services(tmp_path / "services")
    try:
        yield started
    finally:
        started.close()


def run_command(data: Path) -> list[str]:
    """The whole pipeline on the tiny config, its SFT stage long enough for an outage in the middle of it."""
    return [
        *RLHF_COMMAND, "run", "--params", str(PARAMS), "--config", str(TINY), "--data", str(data),
        "-s", f"sft.max_steps={SFT_STEPS}", "-s", "sft.checkpoint_every=2", *SHORTER,
    ]  # fmt: skip


def wait_for_newer_checkpoint(process: subprocess.Popen, sft_dir: Path, than: int) -> int:
    """The step of a complete SFT checkpoint newer than `than`, waited for (while the run goes on)."""
    deadline = time.monotonic() + START_DEADLINE_S
    while time.monotonic() < deadline and process.poll() is None:
        steps = [int(path.name.split("-")[1]) for path in complete_checkpoints(sft_dir / "checkpoints")]
        if steps and max(steps) > than:
            return max(steps)
        time.sleep(0.2)
    return than  # SFT ended (or the run did): the next outage falls in a later stage


def registered_versions(tracking_uri: str) -> dict[str, list[str]]:
    """Every registered model's versions."""
    client = MlflowClient(tracking_uri=tracking_uri)
    return {
        model.name: sorted(version.version for version in client.search_model_versions(f"name = '{model.name}'"))
        for model in client.search_registered_models()
    }


def mlflow_run_statuses(tracking_uri: str) -> list[tuple[str, str]]:
    """(run name, status) of every MLflow run of every experiment."""
    client = MlflowClient(tracking_uri=tracking_uri)
    experiments = [experiment.experiment_id for experiment in client.search_experiments()]
    return [(run.info.run_name, run.info.status) for run in client.search_runs(experiments)]


def flow_run_states(api_url: str) -> list[str]:
    """The state type of every flow run the Prefect API holds."""
    request = urllib.request.Request(
        f"{api_url}/flow_runs/filter", data=b"{}", headers={"Content-Type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return [run["state_type"] for run in json.load(response)]


def assert_finished_with_one_version_each(stdout: str, tracking_uri: str) -> dict[str, str]:
    """Every stage's output complete, one version of each registered model; returns each stage's output directory."""
    lines = summary_lines(stdout)
    stages = {
        key.removeprefix("stage "): value.split(" (")[0] for key, value in lines.items() if key.startswith("stage ")
    }
    assert {"prepare-data", "sft", "reward", "ppo", "evaluate"} <= set(stages)
    assert all((Path(out_dir) / METRICS_FILE).is_file() for out_dir in stages.values())
    versions = registered_versions(tracking_uri)
    assert {"rlhf-policy", "rlhf-reward"} <= set(versions)
    assert all(found == ["1"] for found in versions.values()), versions
    return stages


@pytest.mark.slow  # a whole `rlhf run` process against real servers
def test_both_services_away_mid_stage_are_waited_for_and_the_run_goes_on(services: Services, tmp_path: Path) -> None:
    project = tmp_path / "project"
    project.mkdir()
    data = write_topic_pairs(project / "pairs.jsonl", 160)
    process, sft_dir = start_until_checkpoint(
        run_command(data), project, services.run_env(project), project / "runs", "*/sft", START_DEADLINE_S
    )
    try:
        services.stop_mlflow()
        time.sleep(OUTAGE_S)
        services.start_mlflow()
        wait_for_newer_checkpoint(process, sft_dir, than=2)
        services.stop_prefect()
        time.sleep(OUTAGE_S)
        services.start_prefect()
        process.wait(timeout=RUN_DEADLINE_S)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, 9)
            process.wait()
    output = (project / "killed.log").read_text()

    assert process.returncode == 0, output[-4000:]
    assert "Retrying" not in output and "View run" not in output  # the clients' waits and links are not the user's
    stages = assert_finished_with_one_version_each(output, services.tracking_uri)
    assert Path(stages["sft"]) == sft_dir  # trained on where it was, not again elsewhere
    assert {status for _, status in mlflow_run_statuses(services.tracking_uri)} == {"FINISHED"}
    assert flow_run_states(services.api_url) == ["COMPLETED"]


@pytest.mark.slow  # `rlhf run` twice against real servers
def test_a_tracking_server_away_too_long_stops_the_run_in_one_line_and_a_rerun_resumes(
    services: Services, tmp_path: Path
) -> None:
    project = tmp_path / "project"
    project.mkdir()
    data = write_topic_pairs(project / "pairs.jsonl", 160)
    env = services.run_env(project) | SHORT_MLFLOW_WAIT
    process, sft_dir = start_until_checkpoint(
        run_command(data), project, env, project / "runs", "*/sft", START_DEADLINE_S
    )
    services.stop_mlflow()
    try:
        process.wait(timeout=START_DEADLINE_S)  # stops while the server is away
    finally:
        if process.poll() is None:
            os.killpg(process.pid, 9)
            process.wait()
    stopped = (project / "killed.log").read_text()
    data_dir = sft_dir.parent / "data"
    data_hash = directory_sha256(data_dir)
    services.start_mlflow()

    assert process.returncode == 1, stopped[-4000:]
    assert stopped.splitlines()[-1].startswith(
        f"rlhf: error: stage sft failed: lost the MLflow tracking server at {services.tracking_uri}: it stopped "
        "answering during the run; rerun the same command once it answers: finished stages are reused and the "
        "interrupted one resumes (traceback in runs/logs/rlhf-run-"
    )
    assert "Retry 1/2" not in stopped  # not retried: the client had waited already
    assert (data_dir / METRICS_FILE).is_file() and not (sft_dir / METRICS_FILE).exists()

    rerun = subprocess.run(
        run_command(data), cwd=project, env=env, capture_output=True, text=True, timeout=RUN_DEADLINE_S
    )

    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    stages = assert_finished_with_one_version_each(rerun.stdout, services.tracking_uri)
    assert Path(stages["prepare-data"]) == data_dir and directory_sha256(data_dir) == data_hash  # reused, unchanged
    assert Path(stages["sft"]) == sft_dir  # the interrupted stage resumed where it was
    assert json.loads((sft_dir / METRICS_FILE).read_text()).get("resumed_from", 0) >= 2
    statuses = mlflow_run_statuses(services.tracking_uri)
    assert "RUNNING" not in {status for _, status in statuses}  # the stopped attempt's runs, closed by the rerun
    assert ("sft", "FAILED") in statuses and ("sft", "FINISHED") in statuses


def closed_port_url() -> str:
    """A loopback URL nothing listens on (a port just freed)."""
    return f"http://127.0.0.1:{free_port()}"


def test_mlflow_giving_up_on_its_server_is_one_line_naming_it_and_closes_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    url = closed_port_url()
    client = MlflowClient(tracking_uri=url)
    with pytest.raises(Exception) as raised:
        client.get_run("0" * 32)
    line = lost_service_line(raised.value)
    assert line is not None and line.startswith(f"lost the MLflow tracking server at {url}: it stopped answering")
    close_run(client, "0" * 32, raised.value)  # returns at once: no request to a server that is gone
    close_run(client, "0" * 32, RuntimeError("a stage stopped beside it"))  # the server does not answer: the same


def test_a_refused_request_to_the_prefect_api_is_its_line_and_one_elsewhere_is_not() -> None:
    import httpx
    from prefect.settings import PREFECT_API_URL, temporary_settings

    url = closed_port_url()
    with temporary_settings(updates={PREFECT_API_URL: f"{url}/api"}):
        errors = []
        for path in ("/api/flow_runs/filter", "/datasets/info"):  # the Prefect API, then another server (a Hub)
            with pytest.raises(httpx.ConnectError) as raised:
                httpx.get(url + path)
            errors.append(raised.value)
        assert lost_service_line(errors[0]) == (
            f"lost the Prefect API at {url}/api: it stopped answering during the run; rerun the same command once "
            "it answers: finished stages are reused and the interrupted one resumes"
        )
        assert lost_service_line(errors[1]) is None
    assert lost_service_line(ValueError("not a service")) is None


@pytest.mark.parametrize("storage", [MEMORY_LEASE_STORAGE, FILE_LEASE_STORAGE])
def test_a_prefect_server_keeping_leases_in_memory_is_warned_about(storage: str) -> None:
    with prefect_settings_server(storage) as api_url:
        warning = memory_leases_warning(api_url)
    if storage == MEMORY_LEASE_STORAGE:
        assert warning is not None and warning.startswith(f"the Prefect server at {api_url} keeps concurrency leases")
        assert warning.endswith(f"PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE={FILE_LEASE_STORAGE}")
    else:
        assert warning is None
    assert memory_leases_warning(closed_port_url() + "/api") is None  # a server that does not say: no warning
