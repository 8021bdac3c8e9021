"""What `rlhf run`, `rlhf ablate` and `rlhf promote` do around a flow they run in this process.

`flow_here` is their shared start: the config resolved first (a bad key fails before any service is
asked), then the flow's surroundings below, and the settings every flow's form takes from the shared
options (`--config`, `-s`, `--params`, `--runs-dir`).

They run their flow here and now rather than through a deployment: with PREFECT_API_URL unset,
Prefect starts a temporary server of its own, which inherits this process's environment and reads its
settings when Prefect is first imported (inside the command). `in_process_flow` therefore, in order:
1. sets TEMPORARY_SERVER_SETTINGS and Prefect's client retries (tasks/services/service_outages.py), each unless
   the user set it;
2. checks every service the flow will use (tasks/preflight.py), so an unreachable one fails in seconds,
   and warns about a Prefect server that would forget the training slot's lease in a restart
   (tasks/services/service_outages.py);
3. sets up Prefect's logging (its console handler on the root logger, which step 6 must find), and
4. registers the temporary server Prefect will start (rlhf_cli/temporary_server.py),
5. turns SIGINT and SIGTERM into an orderly stop (`stop_in_order`), and
6. sends other libraries' warnings and notices to a log file under the runs directory, their progress
   bars off when stderr is not a terminal (rlhf_cli/library_logs.py), so a flow that works prints its
   progress and its summary only, and then the log file's name.

An orderly stop: Prefect turns SIGTERM into an exception inside a flow run, marks the run Crashed, and
then sends SIGTERM again to whatever handler was there before; with Python's default one the process died
on the spot, without its exit handlers, and left the temporary server running, re-parented to PID 1 and
listening on its port. Here SIGINT and SIGTERM raise in the main thread from start to end, and
again where Python swallowed the exception in a destructor (the flow logs the stage it stopped in,
flows/pipeline.py); once Prefect has marked the flow run, the command sends the run's last log lines,
stops the server, says in one line that it stopped and exits with 128 + the signal, all within
STOP_GRACE_S of the signal, or else kills the server and exits (flows/stop_signals.py); that deadline
starts at the signal even when Prefect's flow engine takes it and waits for a task thread that trains on
(an ablation's variants train in threads). The stage it stopped in has no `metrics.json`, so it is
incomplete, and the same command run again resumes it (tasks/stages/resume.py). tests/cli/test_run_signals.py checks
it all.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, NoReturn

from flows.stop_signals import (
    STOP_SIGNALS,
    deadline_after_stop_signal,
    exit_without_teardown,
    redeliver_swallowed_stops,
    signal_name,
    stop_signal,
)
from rlhf_cli.library_logs import library_log, run_log_path
from rlhf_cli.options import resolve_config
from rlhf_core.config import Config

if TYPE_CHECKING:  # imported when used: Prefect must read TEMPORARY_SERVER_SETTINGS when first imported
    from prefect.server.api.server import SubprocessASGIServer

# For the temporary Prefect server:
# - its telemetry heartbeat fails offline ("Failed to send telemetry") and races the run for its SQLite
#   database ("database is locked", with a traceback): off, and the client's too (DO_NOT_TRACK), which
#   would otherwise print Prefect's anonymous-usage notice on a first run;
# - it gets 20 s to start by default, which a busy 2-core machine overran: 120 s.
# (It cannot hold the machine's training slot either: tasks/execution/concurrency.py says why, and what does.)
TEMPORARY_SERVER_SETTINGS = {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "DO_NOT_TRACK": "1",
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
}
# From the first SIGINT or SIGTERM to the process's exit: 10 s promised, with room for a loaded machine.
STOP_GRACE_S = 7.0
LOG_DRAIN_S = 2.0  # for the flow run's last log lines to reach the Prefect server
SERVER_STOP_WAIT_S = 2.0  # from SIGTERM to SIGKILL for the temporary server, once the flow run is marked


def use_temporary_server_settings() -> None:
    """Set each of TEMPORARY_SERVER_SETTINGS in this process's environment, unless it is set already."""
    for name, value in TEMPORARY_SERVER_SETTINGS.items():
        os.environ.setdefault(name, value)


@contextmanager
def in_process_flow(runs_dir: Path, tracking_uri: str | None) -> Iterator[Path]:
    """Prepare, check and quieten a flow run in this process (module docstring); yields the log file's path.

    The block should print its summary inside the `with`, so that the log file's line comes after it.

    `tracking_uri` is the resolved config's tracking.tracking_uri (None: MLFLOW_TRACKING_URI or the
    working directory's default store).
    """
    use_temporary_server_settings()
    from tasks.services.service_outages import use_client_retry_settings, warn_about_memory_leases

    use_client_retry_settings()  # Prefect's client waits for its server as long as MLflow's does
    from tasks.preflight import prefect_api_services, tracking_services
    from tasks.services.probes import check_services

    prefect_apis = prefect_api_services()
    check_services([*prefect_apis, *tracking_services(tracking_uri, Path.cwd())])
    warn_about_memory_leases(service.url for service in prefect_apis)
    # Prefect's console handler on the root logger, which the diversion must find: `import prefect` no
    # longer sets it up (Prefect does so lazily, when a flow first runs, after the diversion started).
    from prefect.logging.configuration import ensure_logging_setup

    ensure_logging_setup()

    from rlhf_cli.temporary_server import register_temporary_server

    server = register_temporary_server()
    with stop_in_order(server), library_log(run_log_path(runs_dir)) as log_path:
        yield log_path


@dataclass(frozen=True)
class FlowStart:
    """What a command that runs a flow here has once `flow_here` has started it."""

    config: Config  # the resolved configuration
    shared_settings: dict[str, object]  # the flow settings' `config`, `overrides`, `params_file`, `runs_dir`


@contextmanager
def flow_here(
    params: Path, config: list[Path] | None, overrides: list[str] | None, runs_dir: Path
) -> Iterator[FlowStart]:
    """Resolve the config (a bad key fails here, before any service is asked), then `in_process_flow`."""
    resolved = resolve_config(params, config, overrides)
    with in_process_flow(runs_dir, resolved.tracking.tracking_uri):
        yield FlowStart(
            config=resolved,
            shared_settings={
                "config": [str(path) for path in config or []],
                "overrides": list(overrides or []),
                "params_file": str(params),
                "runs_dir": str(runs_dir),
            },
        )


@contextmanager
def stop_in_order(server: SubprocessASGIServer | None) -> Iterator[None]:
    """While the block runs, the first SIGINT or SIGTERM raises KeyboardInterrupt or Prefect's
    TerminationSignal in the main thread (later ones change nothing, but the one sent again when Python
    swallowed that exception in a destructor: flows/stop_signals.py); once that has unwound the block,
    send the flow run's logs, stop `server`, say so and exit without the interpreter's teardown (module
    docstring), or else `stop_now` at STOP_GRACE_S."""
    from prefect.exceptions import TerminationSignal
    from prefect.logging.handlers import APILogWorker

    from rlhf_cli.temporary_server import stop_server_process

    stopping = threading.Event()

    def raise_once(signal_number: int, frame: FrameType | None) -> None:
        if stopping.is_set():
            return  # Prefect sends SIGTERM again once it has marked the flow run; the stop is under way
        stopping.set()
        raise KeyboardInterrupt if signal_number == signal.SIGINT else TerminationSignal(signal=signal_number)

    previous = {number: signal.signal(number, raise_once) for number in STOP_SIGNALS}
    try:
        with (
            deadline_after_stop_signal(STOP_GRACE_S, partial(stop_now, server)),
            redeliver_swallowed_stops(on_swallowed=stopping.clear),  # raised in a destructor: raise it again
        ):
            yield
    except (KeyboardInterrupt, TerminationSignal) as stop:
        number = stop_signal(stop)
        APILogWorker.drain_all(timeout=LOG_DRAIN_S)  # the flow run's last lines (the stage it stopped) first
        if server is not None:
            stop_server_process(server, SERVER_STOP_WAIT_S)
        print(
            f"rlhf: stopped by {signal_name(number)}: an interrupted stage's output is left incomplete, and the "
            "same command run again resumes it",
            file=sys.stderr,
            flush=True,
        )
        exit_without_teardown(128 + number)
    finally:
        for number, earlier in previous.items():
            signal.signal(number, earlier)


def stop_now(server: SubprocessASGIServer | None, signal_number: int) -> NoReturn:
    """Kill the temporary server (if any) and exit at once: the orderly stop overran STOP_GRACE_S."""
    process = server.server_process if server is not None else None
    if process is not None:
        process.kill()
        process.wait()  # SIGKILL cannot be caught: gone, and reaped, before this process exits
    print(
        f"rlhf: stopped {STOP_GRACE_S:g} s after {signal_name(signal_number)} without finishing the orderly stop: "
        "the temporary Prefect server killed, the flow run may not be marked",
        file=sys.stderr,
        flush=True,
    )
    os._exit(128 + signal_number)
