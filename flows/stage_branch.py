"""A stage that runs beside the pipeline's main line, in a thread of the flow's process.

The thread runs with a copy of the flow's context, so the stage's Prefect task is a task run of the
flow run, and is the `branch` of its own `CoreShare` (tasks/execution/core_share.py): its share of the cores, and
the event that stops its launched process. The main line asks it at each of its stage boundaries whether it failed
(`raise_if_failed`), so a failure beside the main line fails the run before the next main-line stage
starts, with that stage's error; a stage of the main line cannot be interrupted while it trains in the
flow's process, so one that is training runs to its end first. When the main line fails, `stop` stops
the stage beside it (its launched process is terminated) and waits for it, STOP_WAIT_SECONDS at most, so no
process is left running. The thread is a daemon: a stage stuck before it launched anything (waiting for the
training slot), or still logging after its launch, does not keep the process alive after the run has failed.
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable

from flows.failed_stage import mark_failed_stage
from flows.stage_clock import StageClock
from rlhf_core.stage_outputs import StageOutput
from tasks.execution.core_share import CoreShare, branch

# How long `stop` waits for the stage beside to end. Its launched process ends within a poll of the stop
# (rlhf_core/distributed/launcher.py); what the stage does after its launch (its metrics to MLflow, its task
# run's state) is not waited for past this, so that a run stopped by a signal is marked within its stop
# deadline (rlhf_cli/in_process.py STOP_GRACE_S): waiting 60 s for that work overran it in the test suite.
STOP_WAIT_SECONDS = 3.0


class BesideStage:
    """`work` (a stage) run in a thread as `name`, timed by `clock` as a stage beside the main line's `beside`."""

    def __init__(
        self, name: str, work: Callable[[], StageOutput], share: CoreShare, clock: StageClock, beside: str
    ) -> None:
        self.name = name
        self.beside = beside  # the main line's stages it runs beside, for the clock's announcement
        self.work = work
        self.share = share
        self.clock = clock
        self.output: StageOutput | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=contextvars.copy_context().run, args=(self.run,), daemon=True)
        self.thread.name = f"stage-{name}"

    def start(self) -> BesideStage:
        self.thread.start()
        return self

    def run(self) -> None:
        """The thread's body: the stage on its share of the cores, its outcome kept for `result`."""
        self.clock.start_beside(self.name, self.beside)
        try:
            with branch(self.share):
                self.output = self.work()
        except BaseException as error:  # noqa: BLE001 - handed to the main line, which raises it
            mark_failed_stage(error, self.name)  # this stage, not the main line's, failed the run
            self.error = error
        finally:
            self.clock.end_beside(self.name)

    def raise_if_failed(self) -> None:
        """Raise the stage's error if it has failed already (the main line calls this between its stages)."""
        if not self.thread.is_alive() and self.error is not None:
            raise self.error

    def result(self) -> StageOutput:
        """Wait for the stage; its output, or its error raised."""
        self.thread.join()
        if self.error is not None:
            raise self.error
        assert self.output is not None  # the thread ended without an error
        return self.output

    def stop(self) -> None:
        """Stop the stage (its launched process is terminated) and wait for it, STOP_WAIT_SECONDS at most."""
        self.share.stop.set()
        self.thread.join(STOP_WAIT_SECONDS)
