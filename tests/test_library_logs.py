"""`rlhf run` and the stage commands route other libraries' messages to a log file (rlhf_cli/library_logs.py):
each way a library reaches the terminal (the root logger's handlers or Python's last resort, a logger with
handlers of its own, one added later, Python warnings, Prefect's senders, MLflow's eprint) ends in the file,
while Prefect's and the project's messages stay on the terminal. The commands themselves are in
tests/test_orchestration_cli.py (`rlhf run`), test_sft_stage.py and test_eval_cli.py."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator
from pathlib import Path

import prefect  # noqa: F401 - configures the root logger, as in `rlhf run`
import pytest
from mlflow.utils.logging_utils import eprint

from rlhf_cli.library_logs import library_logs_to, run_log_path


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
