"""`rlhf serve`: the deployments of flows/deployments.py served from this process, stopped promptly.

This is Prefect's `serve` (a `Runner` that registers the deployments and runs their flow runs) with
one difference: a bound on shutdown. On SIGINT or SIGTERM Prefect shuts down gracefully, pausing the
deployments' schedules and cancelling the flow runs in flight through the Prefect API; with that server
gone, each call is retried with backoff, and the process outlived the signal by more than 20 s
(issue 31). Here the graceful shutdown gets SHUTDOWN_GRACE_S; past that the process says so in one
line and exits, so `rlhf serve` stops within 5 s of the signal whatever the server does
(tests/test_serve_signals.py, with a real server and process). A shutdown that finishes in time runs
the exit handlers and then skips the interpreter's slow teardown (`exit_without_teardown`).
"""

from __future__ import annotations

import asyncio
import atexit
import os
import signal
import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any, NoReturn

from prefect.deployments.runner import RunnerDeployment
from prefect.exceptions import TerminationSignal
from prefect.runner import Runner
from prefect.settings import PREFECT_API_URL

from flows.deployments import DEPLOYMENTS, runner_deployment

SHUTDOWN_GRACE_S = 3.0  # then the process exits (5 s promised, with room for a loaded machine)
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
STARTED_POLL_S = 0.1

SignalHandler = Callable[[int, FrameType | None], Any]


def serve_deployments(limit: int | None = None) -> None:
    """Register every deployment with the configured Prefect server and run their flow runs, until
    SIGINT or SIGTERM (module docstring).

    `limit` caps the flow runs this process runs at once; training stages are kept one at a time per
    machine by the training concurrency limit (tasks/concurrency.py) whatever it is.
    """
    runner = Runner(limit=limit)  # pauses the schedules on shutdown, as Prefect's `serve` does
    deployments = [runner_deployment(spec) for spec in DEPLOYMENTS]  # built here: async code would get coroutines
    try:
        asyncio.run(serve_until_stopped(runner, deployments))
    except (KeyboardInterrupt, TerminationSignal):
        pass  # the graceful shutdown finished in time
    exit_without_teardown()


async def serve_until_stopped(runner: Runner, deployments: list[RunnerDeployment]) -> None:
    """Register the deployments, start `runner`, put the shutdown deadline in front of its signal
    handlers, and say what is served once the runner runs. `Runner.start` installs its SIGTERM handler
    before its first await, and `asyncio.run` its SIGINT handler before this coroutine runs, so both are
    in place when the deadline wraps them."""
    for deployment in deployments:
        await runner.aadd_deployment(deployment)
    started = asyncio.ensure_future(runner.start())
    await asyncio.sleep(0)  # let runner.start() install its SIGTERM handler
    for signal_number in STOP_SIGNALS:
        signal.signal(signal_number, with_deadline(signal.getsignal(signal_number)))
    while not (runner.started or started.done()):  # "serving" is said once the runner runs
        await asyncio.sleep(STARTED_POLL_S)
    names = ", ".join(f"{deployment.flow_name}/{deployment.name}" for deployment in deployments)
    print(f"serving {len(deployments)} deployments from this process (Ctrl-C stops): {names}", flush=True)
    print("run them from the Prefect UI or with `prefect deployment run FLOW/DEPLOYMENT`", flush=True)
    await started


def with_deadline(previous: SignalHandler | int | None) -> SignalHandler:
    """A handler that starts the shutdown deadline, then does what `previous` did (Prefect's graceful
    shutdown); a second signal changes nothing, the deadline already runs."""
    deadline_started = threading.Event()

    def handle(signal_number: int, frame: FrameType | None) -> None:
        if not deadline_started.is_set():
            deadline_started.set()
            timer = threading.Timer(SHUTDOWN_GRACE_S, stop_now, args=(signal_number,))
            timer.daemon = True
            timer.start()
        if callable(previous):
            previous(signal_number, frame)
        else:
            sys.exit(128 + signal_number)

    return handle


def exit_without_teardown() -> NoReturn:
    """Run the exit handlers (Prefect's log and event workers send what they hold there) and exit with
    status 0, skipping the interpreter's teardown of torch, MLflow and Prefect: that alone took about
    3 s on a loaded 2-core machine, most of the 5 s a stop may take."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def stop_now(signal_number: int) -> None:
    """Exit at once: the graceful shutdown overran its deadline (the Prefect server did not answer)."""
    print(
        f"rlhf serve: stopped {SHUTDOWN_GRACE_S:g} s after {signal.Signals(signal_number).name} without finishing "
        f"the graceful shutdown (the Prefect API at {PREFECT_API_URL.value()} did not answer): the deployments' "
        "schedules may still be active",
        file=sys.stderr,
        flush=True,
    )
    os._exit(128 + signal_number)
