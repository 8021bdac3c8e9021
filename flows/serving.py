"""`rlhf serve`: the deployments of flows/deployments.py served from this process, stopped promptly.

This is Prefect's `serve` (a `Runner` that registers the deployments and runs their flow runs) with
one difference: a bound on shutdown. On SIGINT or SIGTERM Prefect shuts down gracefully, pausing the
deployments' schedules and cancelling the flow runs in flight through the Prefect API; with that server
gone, each call is retried with backoff, and the process outlived the signal by more than 20 s. Here the graceful
shutdown gets SHUTDOWN_GRACE_S; past that the process says so in one
line and exits, so `rlhf serve` stops within 5 s of the signal whatever the server does
(tests/cli/test_serve_signals.py, with a real server and process). A shutdown that finishes in time runs
the exit handlers and then skips the interpreter's slow teardown (flows/stop_signals.py, shared with
`rlhf run`).
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys

from prefect.deployments.runner import RunnerDeployment
from prefect.exceptions import TerminationSignal
from prefect.runner import Runner
from prefect.settings import PREFECT_API_URL

from flows.deployments import DEPLOYMENTS, runner_deployment
from flows.stop_signals import STOP_SIGNALS, exit_without_teardown, signal_name, with_deadline

SHUTDOWN_GRACE_S = 3.0  # then the process exits (5 s promised, with room for a loaded machine)
STARTED_POLL_S = 0.1


def serve_deployments(limit: int | None = None) -> None:
    """Register every deployment with the configured Prefect server and run their flow runs, until
    SIGINT or SIGTERM (module docstring).

    `limit` caps the flow runs this process runs at once; training stages are kept one at a time per
    machine by the training concurrency limit (tasks/execution/concurrency.py) whatever it is.
    """
    runner = Runner(limit=limit)  # pauses the schedules on shutdown, as Prefect's `serve` does
    deployments = [runner_deployment(spec) for spec in DEPLOYMENTS]  # built here: async code would get coroutines
    try:
        asyncio.run(serve_until_stopped(runner, deployments))
    except (KeyboardInterrupt, TerminationSignal):
        pass  # the graceful shutdown finished in time
    exit_without_teardown(0)


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
        signal.signal(signal_number, with_deadline(signal.getsignal(signal_number), SHUTDOWN_GRACE_S, stop_now))
    while not (runner.started or started.done()):  # "serving" is said once the runner runs
        await asyncio.sleep(STARTED_POLL_S)
    names = ", ".join(f"{deployment.flow_name}/{deployment.name}" for deployment in deployments)
    print(f"serving {len(deployments)} deployments from this process (Ctrl-C stops): {names}", flush=True)
    print("run them from the Prefect UI or with `prefect deployment run FLOW/DEPLOYMENT`", flush=True)
    await started


def stop_now(signal_number: int) -> None:
    """Exit at once: the graceful shutdown overran its deadline (the Prefect server did not answer)."""
    print(
        f"rlhf serve: stopped {SHUTDOWN_GRACE_S:g} s after {signal_name(signal_number)} without finishing "
        f"the graceful shutdown (the Prefect API at {PREFECT_API_URL.value()} did not answer): the deployments' "
        "schedules may still be active",
        file=sys.stderr,
        flush=True,
    )
    os._exit(128 + signal_number)
