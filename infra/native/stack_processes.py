"""Detached service processes, found again by the process group recorded in the stack's state directory.

`up` starts each service in its own session (process group) and exits; `down`, a later command, finds the
groups through their pid files and signals them. A group, not a pid, because servers start children
(uvicorn workers, a worker's flow runs) that must end with them.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

STOP_TIMEOUT_S = 20.0
POLL_S = 0.25
LOG_TAIL_CHARS = 3000


class StackError(RuntimeError):
    """A service did not start, or the stack's settings are incomplete: the message says which and why."""


def start_detached(command: list[str], env: dict[str, str], cwd: Path, log_path: Path, user: str | None = None) -> int:
    """Start `command` in a session of its own with output appended to `log_path`; returns its pid,
    which is also its process group id. `user` runs it as that system user (PostgreSQL refuses root)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log_file:
        process = subprocess.Popen(
            command,
            env=env,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            user=user,
        )
    return process.pid


def _processes() -> dict[int, tuple[int, int]]:
    """Every live process (zombies left out): pid -> (parent pid, process group)."""
    table = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue  # ended while we looked
        # After "pid (comm)": state, ppid, pgrp.
        if fields[0] != "Z":
            table[int(entry.name)] = (int(fields[1]), int(fields[2]))
    return table


def group_alive(group: int) -> bool:
    """Whether any process of process group `group` is still running."""
    return any(pgrp == group for _, pgrp in _processes().values())


def family_groups(group: int) -> set[int]:
    """Process group `group` and the groups of every descendant of its processes. A Prefect worker starts
    each flow run in a session of its own, so signalling the worker's group alone leaves its flow runs."""
    table = _processes()
    members = {pid for pid, (_, pgrp) in table.items() if pgrp == group}
    frontier = set(members)
    while frontier:
        frontier = {pid for pid, (ppid, _) in table.items() if ppid in frontier} - members
        members |= frontier
    return {group} | {table[pid][1] for pid in members}


def stop_group(group: int, first_signal: signal.Signals = signal.SIGTERM) -> None:
    """Send `first_signal` to the group, wait up to STOP_TIMEOUT_S for it and its descendants' groups to
    end, then SIGKILL what is left of them. The descendants are found first: once their parent has ended
    they belong to init, and nothing leads to them any more."""
    groups = family_groups(group)
    _signal_group(group, first_signal)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while any(group_alive(member) for member in groups) and time.monotonic() < deadline:
        time.sleep(POLL_S)
    kill_groups(groups)


def kill_groups(groups: set[int]) -> None:
    """SIGKILL each of `groups` (those already gone are skipped)."""
    for member in groups:
        _signal_group(member, signal.SIGKILL)


def _signal_group(group: int, signal_number: signal.Signals) -> None:
    try:
        os.killpg(group, signal_number)
    except ProcessLookupError:
        pass


def log_tail(path: Path) -> str:
    """The end of a service log, for error messages: the reason a service failed is there."""
    if not path.exists():
        return "<no log written>"
    return path.read_text(encoding="utf-8", errors="replace")[-LOG_TAIL_CHARS:]


def http_status(url: str, headers: dict[str, str] | None = None) -> int | None:
    """The HTTP status `url` answers with, or None while nothing accepts the connection."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=5) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return None


def http_json(url: str, headers: dict[str, str]) -> dict | None:
    """The JSON object `url` answers with, or None while it does not answer 200."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=5) as response:
            return json.load(response)
    except (urllib.error.URLError, ConnectionError, TimeoutError, ValueError):
        return None


def wait_until(name: str, group: int, log_path: Path, is_ready: Callable[[], bool], timeout_s: float) -> None:
    """Poll `is_ready` until it holds; raise StackError with the log's end if the service ends or the
    deadline passes first."""
    deadline = time.monotonic() + timeout_s
    while not is_ready():
        if not group_alive(group):
            raise StackError(f"{name} exited before it was ready; log {log_path}:\n{log_tail(log_path)}")
        if time.monotonic() > deadline:
            raise StackError(f"{name} was not ready after {timeout_s:.0f} s; log {log_path}:\n{log_tail(log_path)}")
        time.sleep(POLL_S)
