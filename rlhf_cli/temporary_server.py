"""Prefect's temporary server for the flows `rlhf run` and `rlhf ablate` run in this process, started so
that Ctrl-C at a terminal does not reach it.

With PREFECT_API_URL unset, Prefect's client starts a server of its own when the flow first asks, as a
child process in the command's process group, and stops it at exit (SIGTERM, SIGKILL after 5 s). Ctrl-C
at a terminal signals the whole foreground process group, so the server stopped with the command, before
the command's orderly stop could record the flow run's end on it (rlhf_cli/in_process.py). Started with
SIGINT blocked, which the child keeps, it outlives that stop and ends at the command's exit.
"""

from __future__ import annotations

import signal
import subprocess
from typing import Any

from prefect.server.api.server import SubprocessASGIServer
from prefect.settings import get_current_settings


class TemporaryServer(SubprocessASGIServer):
    """Prefect's temporary server, its process started with SIGINT blocked (module docstring)."""

    def _run_uvicorn_command(self) -> subprocess.Popen[Any]:
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})  # the child inherits the mask
        try:
            return super()._run_uvicorn_command()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def register_temporary_server() -> SubprocessASGIServer | None:
    """The server Prefect will start for this process, registered as a `TemporaryServer`; None with a
    Prefect API configured. Prefect keeps one instance per port and starts the one for no port, so
    creating it before the flow starts is enough (Prefect's own test harness registers its server so)."""
    if get_current_settings().api.url:
        return None
    return TemporaryServer()


def stop_server_process(server: SubprocessASGIServer, wait_s: float) -> None:
    """Stop `server`'s process: SIGTERM, then SIGKILL if it still runs after `wait_s`. Prefect's own stop
    (at exit) waits 5 s, which a server with the run's connections still open used up, half the time a
    stop may take; it then finds the process gone. The server's state is in SQLite, safe either way."""
    process = server.server_process
    if process is None:
        return
    process.terminate()
    try:
        process.wait(timeout=wait_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
