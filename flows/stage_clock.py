"""Each stage's wall-clock minutes in a pipeline run, for the run's summary and its MLflow parent run.

The stages of the main line run one after another: a stage's minutes run from its start to the next
main-line stage's start (or to `end_main_line`, or to `stop`). A stage run beside the main line (the judge
reward model beside SFT and the reward model, flows/pipeline.py) is timed from its own start to its own
end (`start_beside`, `end_beside`), from whichever thread runs it. When stages overlap their minutes add up
to more than the run took, so `total` is the wall-clock time from the first stage's start to the last
stage's end, not the sum. A cache hit shows as a fraction of a minute. The announcement `stage 2/7: sft`
goes to the flow run's log as each stage starts, so `rlhf run` and the Prefect UI show where the run is.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from logging import Logger, LoggerAdapter


class StageClock:
    """Announces and times the stages of one run, in the order given; safe to call from two threads."""

    def __init__(self, order: Sequence[str], logger: Logger | LoggerAdapter) -> None:
        self.order = list(order)
        self.logger = logger
        self.minutes: dict[str, float] = {}
        self.current: str | None = None
        self.since = 0.0
        self.beside: dict[str, float] = {}  # stages running beside the main line -> their start
        self.first: float | None = None
        self.last_end: float | None = None
        self.lock = threading.Lock()

    def start(self, stage: str) -> None:
        """`stage` starts now on the main line, and the one before it (if any) ends at the same instant."""
        with self.lock:
            now = self.begin()
            self.end_current(now)
            self.announce(stage, "")
            self.current, self.since = stage, now

    def start_beside(self, stage: str, beside: str) -> None:
        """`stage` starts now beside the main line's stages `beside` (announced with them); it ends with
        `end_beside`."""
        with self.lock:
            now = self.begin()
            self.announce(stage, f" (beside {beside})")
            self.beside[stage] = now

    def end_beside(self, stage: str) -> None:
        """`stage`, started with `start_beside`, ends now."""
        with self.lock:
            now = time.monotonic()
            self.minutes[stage] = (now - self.beside.pop(stage)) / 60
            self.last_end = max(now, self.last_end or now)

    def end_main_line(self) -> None:
        """The current main-line stage (if any) ends now: the main line waits for a stage beside it."""
        with self.lock:
            self.end_current(time.monotonic())

    def stop(self) -> None:
        """The current main-line stage (if any) ends now."""
        self.end_main_line()

    @property
    def total(self) -> float:
        """Minutes from the first stage's start to the last one's end (0 before any stage ended)."""
        if self.first is None or self.last_end is None:
            return 0.0
        return (self.last_end - self.first) / 60

    @property
    def running(self) -> list[str]:
        """The stages running now: the main line's, then those beside it."""
        return ([self.current] if self.current else []) + list(self.beside)

    def begin(self) -> float:
        """Now, remembered as the run's first start if no stage started before."""
        now = time.monotonic()
        if self.first is None:
            self.first = now
        return now

    def announce(self, stage: str, note: str) -> None:
        self.logger.info("stage %d/%d: %s%s", self.order.index(stage) + 1, len(self.order), stage, note)

    def end_current(self, now: float) -> None:
        """The current main-line stage (if any) ends at `now`."""
        if self.current is not None:
            self.minutes[self.current] = (now - self.since) / 60
            self.last_end = max(now, self.last_end or now)
            self.current = None
