"""Other libraries' log messages during an `rlhf` command go to a log file, not the terminal.

A successful `rlhf run` should show its progress bars, a line per stage and the summary; a stage command
(`rlhf sft`, `rlhf eval`, ...) its summary. The libraries under them also talk: DeepSpeed warns "Setting
accelerator to CPU" on every CPU machine, MLflow warns about pickled models and missing model cards and
announces each registered version, transformers and torch emit deprecation warnings. None of it is the
user's business on a command that works, all of it may matter when one does not, so `library_log`
writes it to a file, named after the command's summary, instead (`library_logs_to`), and switches the
libraries' own progress bars and notices off when the project's are (rlhf_cli/quiet_libraries.py).
`rlhf run` and `rlhf ablate` log under their runs directory (rlhf_cli/in_process.py), the stage
commands under `runs/logs/` (`with_library_log`, applied where rlhf_cli/main.py registers them).

Prefect's messages and the project's own (`rlhf_core`, `tasks`, `flows`, `rlhf_cli`) stay on the
terminal. The libraries reach the terminal four ways, and each is diverted:
- through the root logger, which Prefect gives its console handler when its logging is set up (before
  the diversion starts, by a command that uses Prefect: rlhf_cli/in_process.py), or else Python's
  last-resort handler: a filter on those;
- through handlers of their own, on loggers that do not propagate (`mlflow`, `DeepSpeed`,
  `transformers`), and Python warnings, captured into `py.warnings`: the same filter on those loggers
  (their own records, even when the library adds its handler later, as DeepSpeed does when it is first
  imported) and on the handlers they already have (records of child loggers, such as `mlflow.pyfunc`);
- through loggers named after the class that logs, outside `prefect.`: Prefect's background senders
  (`EventsWorker`, `APILogWorker`), which warn "Still processing items" while `rlhf data add` waits for
  its event to go out: the same filter on those loggers;
- MLflow's `eprint` lines ("Successfully registered model ...", "Created version ..."), which bypass
  logging and print to the stream `mlflow.utils.logging_utils.MLFLOW_LOGGING_STREAM`, looked up at each
  call: that stream is swapped for one that writes to the file. (MLflow's own `disable_logging` does not
  hold: MLflow turns event logs back on when some of its modules are imported.)

Prefect's own reports of a failed task or flow run go to the file too (`is_failure_report`): when a
stage fails inside `rlhf run`, its engine logs the error two or three times, once with the whole
traceback, before the command's one error line, which says it all. They still reach the Prefect API
(its handler is on the run loggers, not the root's). When such a report was written, the error that
leaves the block carries the file's path (`traceback_log`), so the error line can point to it; when the
file cannot be written (a full or read-only runs directory), the report stays on the terminal instead.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import IO, ParamSpec

from rlhf_cli.quiet_libraries import hide_mlflow_run_links, silence_libraries_unless_watched
from rlhf_core.layout import RUNS_DIR

TERMINAL_LOGGERS = ("prefect", "rlhf_core", "tasks", "flows", "rlhf_cli")
SELF_HANDLED_LOGGERS = ("mlflow", "DeepSpeed", "transformers", "py.warnings")
PREFECT_SENDER_LOGGERS = ("EventsWorker", "APILogWorker")
LOG_DIR_NAME = "logs"
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
DIVERTED = "_rlhf_diverted"  # set on a record once written to the file, so no second filter writes it again
PREFECT_RUN_LOGGERS = ("prefect.flow_runs", "prefect.task_runs")  # a flow or task run's logger, Prefect's or ours
PREFECT_SPEC = importlib.util.find_spec("prefect")  # found without importing Prefect (stage commands do not)
PREFECT_DIR = os.path.dirname(PREFECT_SPEC.origin or "") + os.sep if PREFECT_SPEC else None
FINISHED = "Finished in state "
TRACEBACK_LOG_ATTRIBUTE = "rlhf_traceback_log"  # on an error: the log file its tracebacks were written to


def is_failure_report(record: logging.LogRecord) -> bool:
    """Whether `record` is Prefect's engine reporting a failed, crashed or retried task or flow run: an
    error (with or without a traceback), or a flow run's "Finished in state" other than Completed. The
    project's own messages on the same loggers (the stage lines, a stop's stage) are not."""
    if not record.name.startswith(PREFECT_RUN_LOGGERS) or PREFECT_DIR is None:
        return False
    if not record.pathname.startswith(PREFECT_DIR):
        return False
    if record.levelno >= logging.ERROR or record.exc_info:
        return True
    message = record.getMessage()
    return message.startswith(FINISHED) and not message.startswith(f"{FINISHED}Completed")


def traceback_log(error: BaseException) -> Path | None:
    """The log file Prefect's report of `error`, with its traceback, was written to, if any."""
    path = getattr(error, TRACEBACK_LOG_ATTRIBUTE, None)
    return path if isinstance(path, Path) else None


class ToLogFile(logging.Filter):
    """Passes the records of TERMINAL_LOGGERS but Prefect's failure reports; writes every other record to
    `file_handler` and drops it. A failure report the file could not take passes; `reported` says
    whether one was written."""

    def __init__(self, file_handler: LazyFileHandler) -> None:
        super().__init__()
        self.file_handler = file_handler
        self.reported = False

    def filter(self, record: logging.LogRecord) -> bool:
        if is_failure_report(record):
            return not self.divert(record)
        if record.name.split(".")[0] in TERMINAL_LOGGERS:
            return True
        self.divert(record)
        return False

    def divert(self, record: logging.LogRecord) -> bool:
        """Write `record` to the file, once (several filters see it); whether the file has it."""
        if not getattr(record, DIVERTED, False):
            setattr(record, DIVERTED, True)
            self.file_handler.handle(record)
            if is_failure_report(record) and not self.file_handler.failed:
                self.reported = True
        return not self.file_handler.failed


class LogFileStream:
    """A text stream whose lines become INFO records of logger `name`, written to `file_handler`."""

    def __init__(self, file_handler: logging.Handler, name: str) -> None:
        self.file_handler = file_handler
        self.name = name

    def write(self, text: str) -> int:
        for line in text.splitlines():
            if line.strip():
                record = logging.LogRecord(self.name, logging.INFO, __file__, 0, line, None, None)
                self.file_handler.handle(record)
        return len(text)

    def flush(self) -> None:
        self.file_handler.flush()


class LazyFileHandler(logging.FileHandler):
    """A FileHandler that creates the file, and its directory, only when the first record arrives."""

    def __init__(self, path: Path) -> None:
        super().__init__(path, encoding="utf-8", delay=True)
        self.failed = False  # a write failed: the file is on a full or read-only file system

    def _open(self) -> IO[str]:  # FileHandler's hook for opening its stream
        Path(self.baseFilename).parent.mkdir(parents=True, exist_ok=True)
        return super()._open()

    def emit(self, record: logging.LogRecord) -> None:
        """FileHandler's emit, where opening the file (which FileHandler does outside its error handling)
        fails as a write does: the record is lost and `failed` set, never an error in the caller."""
        try:
            super().emit(record)
        except OSError:
            self.handleError(record)

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 - logging's name
        """Remember the failure, silently: a "Logging error" traceback on the terminal would bury the
        command's own line, which names an unwritable runs directory anyway."""
        self.failed = True


def run_log_path(runs_dir: Path, command: str = "run") -> Path:
    """`<runs_dir>/logs/rlhf-<command>-<YYYYmmdd-HHMMSS>-<pid>.log`: one file per command run."""
    return Path(runs_dir) / LOG_DIR_NAME / f"rlhf-{command}-{datetime.now():%Y%m%d-%H%M%S}-{os.getpid()}.log"


@contextmanager
def library_logs_to(path: Path) -> Iterator[Path]:
    """Divert other libraries' log output to `path` (appended; made at the first message) while the block
    runs; see the module docstring. Importing MLflow first configures its logging, so its handlers exist."""
    from mlflow.utils import logging_utils

    file_handler = LazyFileHandler(path)
    file_handler.setFormatter(logging.Formatter(LOG_FORMAT))
    divert = ToLogFile(file_handler)
    filtered: list[logging.Filterer] = [*logging.getLogger().handlers, logging.lastResort]
    for name in (*SELF_HANDLED_LOGGERS, *PREFECT_SENDER_LOGGERS):
        logger = logging.getLogger(name)
        filtered += [logger, *logger.handlers]
    for filterer in filtered:
        filterer.addFilter(divert)
    showwarning = warnings.showwarning
    logging.captureWarnings(True)
    event_stream = logging_utils.MLFLOW_LOGGING_STREAM
    logging_utils.MLFLOW_LOGGING_STREAM = LogFileStream(file_handler, "mlflow")
    try:
        yield path
    except Exception as error:
        if divert.reported:
            setattr(error, TRACEBACK_LOG_ATTRIBUTE, path)  # for the command's error line (rlhf_cli/main.py)
        raise
    finally:
        logging_utils.MLFLOW_LOGGING_STREAM = event_stream
        if warnings.showwarning is not showwarning:
            logging.captureWarnings(False)
        for filterer in filtered:
            filterer.removeFilter(divert)
        file_handler.close()


@contextmanager
def library_log(path: Path) -> Iterator[Path]:
    """Run a command's block quietly: the libraries' own bars and notices off unless someone watches stderr
    (rlhf_cli/quiet_libraries.py), their messages in `path`. After a block that worked and left messages,
    print the file's name (so print the summary inside the block); after a failure, its error is last.
    MLflow's run links stay off stdout in every case: the summary names the run."""
    silence_libraries_unless_watched()
    hide_mlflow_run_links()
    with library_logs_to(path):
        yield path
    if path.exists():
        print(f"other libraries' messages (warnings, MLflow, DeepSpeed): {path}", flush=True)


P = ParamSpec("P")


def with_library_log(command: str) -> Callable[[Callable[P, None]], Callable[P, None]]:
    """Run a CLI command's function inside `library_log(runs/logs/rlhf-<command>-*.log)`; the wrapper keeps
    the function's signature (`functools.wraps`), from which typer reads the options."""

    def decorate(function: Callable[P, None]) -> Callable[P, None]:
        @functools.wraps(function)
        def logged(*args: P.args, **kwargs: P.kwargs) -> None:
            # under the default runs dir, beside `rlhf run`'s logs
            with library_log(run_log_path(RUNS_DIR, command)):
                function(*args, **kwargs)

        return logged

    return decorate
