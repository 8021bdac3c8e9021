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
    assert sum(clock.minutes.values()) == pytest.approx(6.6) == clock.total  # one after another: sum = wall clock
    assert [record.getMessage() for record in caplog.records] == ["stage 1/3: a", "stage 2/3: b", "stage 3/3: c"]


def test_a_stage_beside_the_main_line_is_timed_from_its_own_start_to_its_end(
    monkeypatch: pytest.MonkeyPatch, caplog
) -> None:
    # a starts; j starts beside it; b follows a; the main line ends and waits for j; j ends; stop times nothing
    seconds = iter([0.0, 6.0, 60.0, 120.0, 180.0, 200.0])
    monkeypatch.setattr(stage_clock.time, "monotonic", lambda: next(seconds))
    clock = StageClock(["a", "b", "j"], logging.getLogger("clock-test"))
    with caplog.at_level(logging.INFO, logger="clock-test"):
        clock.start("a")
        clock.start_beside("j", "a and b")
        assert clock.running == ["a", "j"]
        clock.start("b")
        clock.end_main_line()
        clock.end_beside("j")
        clock.stop()
    assert clock.minutes == pytest.approx({"a": 1.0, "b": 1.0, "j": 29 / 10})
    assert clock.total == pytest.approx(3.0)  # wall clock, first start to last end: less than the sum, 4.9
    assert clock.running == []
    announced = [record.getMessage() for record in caplog.records]
    assert announced == ["stage 1/3: a", "stage 3/3: j (beside a and b)", "stage 2/3: b"]
