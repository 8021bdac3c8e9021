"""`rlhf run` and the stage commands route other libraries' messages to a log file (rlhf_cli/library_logs.py):
each way a library reaches the terminal (the root logger's handlers or Python's last resort, a logger with
handlers of its own, one added later, Python warnings, Prefect's senders, MLflow's eprint) ends in the file,
while Prefect's and the project's messages stay on the terminal. Prefect's own reports of a failed task or
flow run (with their tracebacks) go to the file too, and the error carries the file's path, so that a
stage failing inside `rlhf run` shows the stage lines and then one error line naming the stage and the
file (slow: a real `rlhf run` on data that fails its first stage). The other commands are in
tests/orchestration/test_orchestration_cli.py (`rlhf run`), test_sft_stage.py and test_eval_cli.py."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
from mlflow import MlflowClient
from mlflow.environment_variables import MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT
from mlflow.utils.logging_utils import eprint
from prefect.logging.configuration import ensure_logging_setup

from fixtures.commands import RLHF_COMMAND
from fixtures.pairs import write_topic_pairs
from fixtures.paths import PARAMS, ROOT, TINY
from flows.failed_stage import failed_stage, mark_failed_stage
from rlhf_cli.library_logs import (
    PREFECT_DIR,
    TRACEBACK_LOG_ATTRIBUTE,
    library_log,
    library_logs_to,
    run_log_path,
    traceback_log,
)
from rlhf_cli.main import error_line

RUN_TIMEOUT_S = 900  # a guard for a hung run, not a measurement

ensure_logging_setup()  # Prefect's console handler on the root logger, as `rlhf run` sets it up


class Recorder(logging.Handler):
    """A stand-in for a terminal handler: keeps the messages it would print."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def terminal() -> Iterator[Recorder]:
    """A recorder on the root logger, beside Prefect's console handler."""
    recorder = Recorder()
    logging.getLogger().addHandler(recorder)
    yield recorder
    logging.getLogger().removeHandler(recorder)


def test_library_messages_go_to_the_file_and_ours_stay_on_the_terminal(
    terminal: Recorder, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = run_log_path(tmp_path / "runs")
    deepspeed = logging.getLogger("DeepSpeed")
    its_own_handler = Recorder()
    with library_logs_to(path):
        deepspeed.addHandler(its_own_handler)  # as DeepSpeed does when it is first imported, mid-run
        deepspeed.warning("Setting accelerator to CPU.")
        logging.getLogger("mlflow.pyfunc").warning("Passing a Python object as `python_model` uses CloudPickle")
        logging.getLogger("urllib3.connectionpool").warning("Retrying connection")
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.warn("a deprecated argument", DeprecationWarning, stacklevel=1)
        eprint("Successfully registered model 'rlhf-policy'.")
        logging.getLogger("EventsWorker").warning("Still processing items: 1 items remaining...")
        logging.getLogger("rlhf_core.output_lock").warning("took over the lock of a dead process")
        logging.getLogger("prefect.tests").warning("a Prefect message")
    deepspeed.removeHandler(its_own_handler)
    logging.getLogger("urllib3.connectionpool").warning("after the run")

    logged = path.read_text(encoding="utf-8")
    assert path.parent == tmp_path / "runs" / "logs"
    for message in (
        "WARNING DeepSpeed: Setting accelerator to CPU.",
        "WARNING mlflow.pyfunc: Passing a Python object",
        "WARNING urllib3.connectionpool: Retrying connection",
        "WARNING py.warnings: ",
        "a deprecated argument",
        "INFO mlflow: Successfully registered model 'rlhf-policy'.",
        "WARNING EventsWorker: Still processing items",
    ):
        assert message in logged
    assert "took over the lock" not in logged and "a Prefect message" not in logged
    assert terminal.messages == ["took over the lock of a dead process", "a Prefect message", "after the run"]
    assert its_own_handler.messages == []
    captured = capsys.readouterr()
    assert "Successfully registered" not in captured.err + captured.out


def test_a_command_switches_mlflow_s_run_links_off_unless_the_user_chose(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The switch MLflow itself reads before printing a run's links is on inside a command's block; a user's
    own setting of it stays. (The next test sees MLflow honour it on a real server.)"""
    monkeypatch.delenv("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", raising=False)  # restored after the test
    with library_log(run_log_path(tmp_path / "runs")):
        assert MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT.get() is True
    monkeypatch.setenv("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "false")
    with library_log(run_log_path(tmp_path / "runs")):
        assert MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT.get() is False


@pytest.mark.slow  # the session's S3 and MLflow servers, which no other fast test starts
def test_runs_ending_on_a_tracking_server_print_no_links_on_stdout(
    mlflow_server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """MLflow prints "View run ... at" and "View experiment at" to stdout when a run ends on a server (two
    lines per stage of `rlhf run`, eight for registration); the command's summary names the run instead."""
    monkeypatch.delenv("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", raising=False)  # restored after the test
    client = MlflowClient(mlflow_server)
    with library_log(run_log_path(tmp_path / "runs")):
        run = client.create_run(experiment_id="0", run_name="a-stage")
        client.set_terminated(run.info.run_id)

    assert client.get_run(run.info.run_id).info.status == "FINISHED"
    assert "View run" not in capsys.readouterr().out


def test_nothing_to_divert_leaves_no_file(tmp_path: Path) -> None:
    path = run_log_path(tmp_path / "runs")
    with library_logs_to(path):
        logging.getLogger("rlhf_core.training").warning("our own warning")
    assert not path.parent.exists()


def test_without_prefect_s_handler_the_last_resort_is_diverted_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A stage command does not import Prefect: with no handler on the root logger, Python prints warnings
    through its last-resort handler, which the diversion filters the same way."""
    monkeypatch.setattr(logging.getLogger(), "handlers", [])
    path = run_log_path(tmp_path / "runs", "sft")
    with library_logs_to(path):
        logging.getLogger("a_library.module").warning("a library warning")
        logging.getLogger("rlhf_core.training").warning("our own warning")

    assert path.name.startswith("rlhf-sft-")
    assert "WARNING a_library.module: a library warning" in path.read_text(encoding="utf-8")
    assert capsys.readouterr().err == "our own warning\n"


RUN_NAMES = {"flow_run_name": "test-flow-run", "task_run_name": "test-task-run"}  # what Prefect's format shows


def run_record(name: str, level: int, message: str, pathname: str, exc_info: object = None) -> logging.LogRecord:
    """A record of a flow or task run's logger `name`, logged from `pathname`."""
    logger = logging.getLogger(name)
    return logger.makeRecord(name, level, pathname, 1, message, None, exc_info, extra=RUN_NAMES)  # type: ignore[arg-type]


def prefect_engine_record(name: str, level: int, message: str, exc_info: object = None) -> logging.LogRecord:
    """A record as Prefect's flow or task engine logs it (its pathname inside the Prefect package)."""
    return run_record(name, level, message, f"{PREFECT_DIR}flow_engine.py", exc_info)


def test_prefect_s_failure_reports_go_to_the_file_and_the_error_carries_its_path(
    terminal: Recorder, tmp_path: Path
) -> None:
    """The engine's reports of a failed run (the exception with its traceback, the task's and the flow's
    "Finished in state Failed") go to the file; the project's lines on the same loggers (a stage's start)
    and a completed run's report stay; the error leaving the block names the file."""
    path = run_log_path(tmp_path / "runs")
    root = logging.getLogger()  # handled there: Prefect's API handler on the run loggers wants a flow run
    with pytest.raises(ValueError) as raised, library_logs_to(path):
        root.handle(
            run_record(
                "prefect.flow_runs", logging.INFO, "stage 1/7: prepare-data", str(ROOT / "flows" / "stage_clock.py")
            )
        )
        try:
            raise ValueError("no valid preference pairs remain")
        except ValueError as error:
            root.handle(
                prefect_engine_record(
                    "prefect.flow_runs", logging.ERROR, "Encountered exception during execution", sys.exc_info()
                )
            )
            root.handle(
                prefect_engine_record(
                    "prefect.task_runs", logging.ERROR, "Finished in state Failed('Task run encountered an exception')"
                )
            )
            root.handle(
                prefect_engine_record(
                    "prefect.flow_runs", logging.INFO, "Finished in state Failed('Flow run encountered an exception')"
                )
            )
            root.handle(prefect_engine_record("prefect.flow_runs", logging.INFO, "Finished in state Completed()"))
            raise error

    assert terminal.messages == ["stage 1/7: prepare-data", "Finished in state Completed()"]
    logged = path.read_text(encoding="utf-8")
    assert (
        "ERROR prefect.flow_runs: Encountered exception during execution\nTraceback (most recent call last):" in logged
    )
    assert "ValueError: no valid preference pairs remain" in logged
    assert "Finished in state Failed('Task run" in logged and "Finished in state Failed('Flow run" in logged
    assert traceback_log(raised.value) == path


def test_a_failure_report_the_file_cannot_take_stays_on_the_terminal(
    terminal: Recorder, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A runs directory that cannot be written (here: a file where the directory should be): no "Logging
    error" traceback, the report on the terminal, and no file for the error line to point to."""
    (tmp_path / "runs").write_text("not a directory")
    with pytest.raises(ValueError) as raised, library_logs_to(run_log_path(tmp_path / "runs")):
        logging.getLogger().handle(prefect_engine_record("prefect.flow_runs", logging.ERROR, "Encountered exception"))
        raise ValueError("boom")
    assert terminal.messages == ["Encountered exception"]
    assert traceback_log(raised.value) is None
    assert "Logging error" not in capsys.readouterr().err


def test_the_error_line_names_the_stage_and_the_log_file() -> None:
    """The innermost stage mark wins (a stage beside the main line marks its own error first)."""
    error = ValueError("no  valid\npairs")
    assert error_line(error) == "no  valid\npairs"
    mark_failed_stage(error, "judge-reward")
    mark_failed_stage(error, "sft")
    assert failed_stage(error) == "judge-reward"
    setattr(error, TRACEBACK_LOG_ATTRIBUTE, Path("runs/logs/rlhf-run-1.log"))  # as library_logs_to sets it
    assert error_line(error) == "stage judge-reward failed: no  valid\npairs (traceback in runs/logs/rlhf-run-1.log)"


@pytest.mark.slow  # a whole `rlhf run` process, with Prefect's temporary server
def test_a_stage_failing_inside_rlhf_run_shows_the_stage_lines_then_one_error_line(tmp_path: Path) -> None:
    """Data whose every row is dropped fails the first stage: the terminal shows the stage's start and one
    error line naming the stage and the log file, which holds the traceback; no traceback, no Prefect
    failure report on the terminal."""
    project = tmp_path / "project"
    project.mkdir()
    data = write_topic_pairs(project / "pairs.jsonl", 40, identical=True)
    env = {key: value for key, value in os.environ.items() if not key.startswith(("PREFECT_", "MLFLOW_"))}
    env |= {"PREFECT_HOME": str(tmp_path / "prefect-home"), "PYTHONPATH": str(ROOT)}
    command = [*RLHF_COMMAND, "run", "--data", str(data), "--params", str(PARAMS), "--config", str(TINY)]
    stderr_file = tmp_path / "stderr.txt"
    with stderr_file.open("w") as stderr:
        result = subprocess.run(
            command, cwd=project, env=env, stdout=subprocess.PIPE, stderr=stderr, text=True, timeout=RUN_TIMEOUT_S
        )

    terminal = (result.stdout + stderr_file.read_text()).splitlines()
    assert result.returncode == 1, terminal[-40:]
    assert not [line for line in terminal if "Traceback" in line or "Finished in state" in line and "Failed" in line]
    assert not [line for line in terminal if re.search(r"\bERROR\b", line)]
    assert any(line.endswith("stage 1/7: prepare-data") for line in terminal)
    (error,) = [line for line in terminal if "data validation failed" in line]  # said once
    found = re.fullmatch(
        r"rlhf: error: stage prepare-data failed: data validation failed for pairs\.jsonl: .* \(traceback in "
        r"(runs/logs/rlhf-run-\S+\.log)\)",
        error,
    )
    assert found, error
    logged = (project / found.group(1)).read_text(encoding="utf-8")
    assert "Traceback (most recent call last)" in logged and "DataValidationError: data validation failed" in logged
