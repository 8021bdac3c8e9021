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
- through the root logger, which Prefect gives its console handler when imported (before the diversion
  starts, by a command that uses Prefect), or else Python's last-resort handler: a filter on those;
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
"""

from __future__ import annotations

import functools
import logging
import os
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import IO, ParamSpec

from rlhf_cli.quiet_libraries import silence_libraries_unless_watched
from rlhf_core.layout import RUNS_DIR

TERMINAL_LOGGERS = ("prefect", "rlhf_core", "tasks", "flows", "rlhf_cli")
SELF_HANDLED_LOGGERS = ("mlflow", "DeepSpeed", "transformers", "py.warnings")
PREFECT_SENDER_LOGGERS = ("EventsWorker", "APILogWorker")
LOG_DIR_NAME = "logs"
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
DIVERTED = "_rlhf_diverted"  # set on a record once written to the file, so no second filter writes it again


class ToLogFile(logging.Filter):
    """Passes the records of TERMINAL_LOGGERS; writes every other record to `file_handler` and drops it."""

    def __init__(self, file_handler: logging.Handler) -> None:
        super().__init__()
        self.file_handler = file_handler

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name.split(".")[0] in TERMINAL_LOGGERS:
            return True
        if not getattr(record, DIVERTED, False):
            setattr(record, DIVERTED, True)
            self.file_handler.handle(record)
        return False


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

    def _open(self) -> IO[str]:  # FileHandler's hook for opening its stream
        Path(self.baseFilename).parent.mkdir(parents=True, exist_ok=True)
        return super()._open()


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
    print the file's name (so print the summary inside the block); after a failure, its error is last."""
    silence_libraries_unless_watched()
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
