"""flows/stage_clock.py: each stage's minutes run from its start to the next stage's (or the run's end)."""

from __future__ import annotations

import logging

import pytest

from flows import stage_clock
from flows.stage_clock import StageClock


def test_minutes_run_from_each_start_to_the_next(monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    seconds = iter([0.0, 90.0, 96.0, 396.0, 400.0])  # starts of a, b, c; the two stops
    monkeypatch.setattr(stage_clock.time, "monotonic", lambda: next(seconds))
    clock = StageClock(["a", "b", "c"], logging.getLogger("clock-test"))
    with caplog.at_level(logging.INFO, logger="clock-test"):
        for stage in ("a", "b", "c"):
            clock.start(stage)
        clock.stop()
        clock.stop()  # a second stop times nothing more
    assert clock.minutes == {"a": 1.5, "b": 0.1, "c": 5.0}
    assert sum(clock.minutes.values()) == pytest.approx(6.6)  # the run summary's total
    assert [record.getMessage() for record in caplog.records] == ["stage 1/3: a", "stage 2/3: b", "stage 3/3: c"]
