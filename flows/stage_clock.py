"""Each stage's wall-clock minutes in a pipeline run, for the run's summary and its MLflow parent run.

A stage's minutes run from its start to the next stage's start (the last one's to `stop`), so they add up
to the time from the first stage's start to the run's end; a cache hit shows as a fraction of a minute.
The announcement `stage 2/7: sft` goes to the flow run's log as each stage starts, so `rlhf run` and the
Prefect UI show where the run is.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from logging import Logger, LoggerAdapter


class StageClock:
    """Announces and times the stages of one run, in the order given."""

    def __init__(self, order: Sequence[str], logger: Logger | LoggerAdapter) -> None:
        self.order = list(order)
        self.logger = logger
        self.minutes: dict[str, float] = {}
        self.current: str | None = None
        self.since = 0.0

    def start(self, stage: str) -> None:
        """`stage` starts now, and the one before it (if any) ends at the same instant."""
        now = time.monotonic()
        self.end_current(now)
        self.logger.info("stage %d/%d: %s", self.order.index(stage) + 1, len(self.order), stage)
        self.current, self.since = stage, now

    def stop(self) -> None:
        """The current stage (if any) ends now."""
        self.end_current(time.monotonic())

    def end_current(self, now: float) -> None:
        """The current stage (if any) ends at `now`."""
        if self.current is not None:
            self.minutes[self.current] = (now - self.since) / 60
            self.current = None
