"""Where training metrics go: a tiny protocol the loop writes to, with null, JSONL and fan-out loggers.

The loop only knows `MetricsLogger`; the MLflow adapter (in `tasks/`) implements the same three
methods, so this library never imports MLflow. Loggers that can rewrite their own history also
implement `RewindableLogger.truncate_after`, which a resumed run calls so that the steps it repeats
(those after the checkpoint it restarts from) never appear twice.
"""

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from rlhf_core.atomic import atomic_write_text


@runtime_checkable
class MetricsLogger(Protocol):
    """What the training loop calls. `step` is the global optimizer step the metrics belong to."""

    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...

    def log_params(self, params: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


@runtime_checkable
class RewindableLogger(MetricsLogger, Protocol):
    """A logger whose history can be cut back to `step` when a run resumes from that step's checkpoint."""

    def truncate_after(self, step: int) -> None: ...


class NullLogger:
    """The default logger: discards everything."""

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        pass

    def log_params(self, params: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


class JsonlLogger:
    """Appends one line `{"step": step, **metrics}` per `log_metrics` call to `path`.

    Each line is flushed at once, so a killed process loses at most the line it was writing; such a
    partial last line is not valid JSON and `truncate_after` drops it. Params go to a sibling file
    `<path stem>.params.json` (merged and rewritten atomically), which keeps the metrics file one
    uniform record per line.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.params_path = self.path.with_name(self.path.stem + ".params.json")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", encoding="utf-8")

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self._file.write(json.dumps({"step": step, **metrics}) + "\n")
        self._file.flush()

    def log_params(self, params: dict[str, Any]) -> None:
        merged = json.loads(self.params_path.read_text()) if self.params_path.exists() else {}
        merged.update(params)
        atomic_write_text(self.params_path, json.dumps(merged, indent=2, sort_keys=True, default=str))

    def truncate_after(self, step: int) -> None:
        """Keep only complete lines whose step is <= `step` (the file is rewritten atomically)."""
        self._file.close()
        kept = [line for line in self.path.read_text(encoding="utf-8").splitlines() if _step_of(line) <= step]
        atomic_write_text(self.path, "".join(line + "\n" for line in kept))
        self._file = self.path.open("a", encoding="utf-8")

    def close(self) -> None:
        self._file.close()


class MultiLogger:
    """Sends every call to each of `loggers` (e.g. JSONL on disk plus MLflow)."""

    def __init__(self, loggers: Sequence[MetricsLogger]) -> None:
        self.loggers = list(loggers)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        for logger in self.loggers:
            logger.log_metrics(metrics, step)

    def log_params(self, params: dict[str, Any]) -> None:
        for logger in self.loggers:
            logger.log_params(params)

    def truncate_after(self, step: int) -> None:
        """Truncate the loggers that can rewrite history; the others (e.g. MLflow) keep theirs."""
        for logger in self.loggers:
            if isinstance(logger, RewindableLogger):
                logger.truncate_after(step)

    def close(self) -> None:
        for logger in self.loggers:
            logger.close()


def _step_of(line: str) -> float:
    """The step of one JSONL line; a partial or malformed line counts as infinitely late (dropped)."""
    try:
        return int(json.loads(line)["step"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError):
        return float("inf")
