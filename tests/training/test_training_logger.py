"""Metrics loggers: JSONL lines, truncation on resume (including a torn last line), params, fan-out."""

import json
from pathlib import Path
from typing import Any

from rlhf_core.training.logger import JsonlLogger, MetricsLogger, MultiLogger, NullLogger, RewindableLogger


def read_lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_jsonl_logger_appends_one_line_per_call_across_reopenings(tmp_path: Path) -> None:
    path = tmp_path / "logs" / "history.jsonl"
    logger = JsonlLogger(path)
    logger.log_metrics({"loss": 1.5, "lr": 0.1}, step=1)
    logger.log_metrics({"loss": 1.25}, step=2)
    logger.close()
    reopened = JsonlLogger(path)
    reopened.log_metrics({"loss": 1.0}, step=3)
    reopened.close()
    assert read_lines(path) == [
        {"step": 1, "loss": 1.5, "lr": 0.1},
        {"step": 2, "loss": 1.25},
        {"step": 3, "loss": 1.0},
    ]


def test_truncate_after_drops_later_steps_and_a_torn_last_line(tmp_path: Path) -> None:
    path = tmp_path / "history.jsonl"
    logger = JsonlLogger(path)
    for step in range(1, 6):
        logger.log_metrics({"loss": float(step)}, step=step)
    logger.close()
    with path.open("a") as handle:
        handle.write('{"step": 6, "lo')  # the process was killed while writing this line
    resumed = JsonlLogger(path)
    resumed.truncate_after(3)
    resumed.log_metrics({"loss": 4.5}, step=4)
    resumed.close()
    assert [row["step"] for row in read_lines(path)] == [1, 2, 3, 4]
    assert read_lines(path)[-1]["loss"] == 4.5


def test_params_are_merged_into_a_sibling_json_file(tmp_path: Path) -> None:
    logger = JsonlLogger(tmp_path / "history.jsonl")
    logger.log_params({"lr": 0.1, "loop": {"seed": 3}})
    logger.log_params({"total_steps": 20})
    logger.close()
    params = json.loads((tmp_path / "history.params.json").read_text())
    assert params == {"lr": 0.1, "loop": {"seed": 3}, "total_steps": 20}
    assert (tmp_path / "history.jsonl").read_text() == ""


class RecordingLogger:
    """A non-rewindable logger, like the MLflow adapter."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.calls.append(("metrics", (step, metrics)))

    def log_params(self, params: dict[str, Any]) -> None:
        self.calls.append(("params", params))

    def close(self) -> None:
        self.calls.append(("close", None))


def test_multi_logger_forwards_everything_and_truncates_only_rewindable_loggers(tmp_path: Path) -> None:
    recording, jsonl = RecordingLogger(), JsonlLogger(tmp_path / "history.jsonl")
    multi = MultiLogger([recording, jsonl, NullLogger()])
    assert isinstance(multi, RewindableLogger) and isinstance(recording, MetricsLogger)
    assert not isinstance(recording, RewindableLogger) and not isinstance(NullLogger(), RewindableLogger)
    multi.log_params({"seed": 1})
    multi.log_metrics({"loss": 2.0}, step=1)
    multi.log_metrics({"loss": 1.0}, step=2)
    multi.truncate_after(1)
    multi.close()
    assert recording.calls == [
        ("params", {"seed": 1}),
        ("metrics", (1, {"loss": 2.0})),
        ("metrics", (2, {"loss": 1.0})),
        ("close", None),
    ]
    assert read_lines(tmp_path / "history.jsonl") == [{"step": 1, "loss": 2.0}]
