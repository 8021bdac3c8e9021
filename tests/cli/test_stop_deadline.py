"""The stop deadline of the in-process commands (`rlhf run`, `rlhf ablate`, `rlhf promote`) holds while a task
trains in a thread of the flow (flows/stop_signals.py `deadline_after_stop_signal`, rlhf_cli/in_process.py);
`rlhf serve`'s handler (`with_deadline`) keeps SIGINT a KeyboardInterrupt when no Python handler was there.

During a flow run Prefect's engine takes SIGTERM with a handler of its own and calls the command's only after
the flow's task threads have ended: an ablation signalled while a variant's PPO trained in one went on for
minutes (seen: 35 s and counting). The deadline must start at the signal whichever handler takes it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from fixtures.paths import ROOT
from fixtures.processes import group_processes
from flows.stop_signals import with_deadline
from rlhf_cli.in_process import TEMPORARY_SERVER_SETTINGS

STOP_DEADLINE_S = 10  # a stop within 10 s
START_DEADLINE_S = 300  # a guard for a slow start (Prefect's temporary server), not a measurement

FLOW_WITH_A_TASK_IN_A_THREAD = """
import time
from prefect import flow, task
from rlhf_cli.in_process import stop_in_order
from rlhf_cli.temporary_server import register_temporary_server

@task
def trains_on():
    print("training", flush=True)
    time.sleep(300)

@flow
def one_task_in_a_thread():
    trains_on.submit().wait()

with stop_in_order(register_temporary_server()):  # as `rlhf run` does (rlhf_cli/in_process.py)
    one_task_in_a_thread()
"""

SWALLOWED_SIGNAL = """
import os, signal, sys, time
from flows.stop_signals import deadline_after_stop_signal

def overrun(number):
    print(f"deadline after {number}", flush=True)
    os._exit(3)

with deadline_after_stop_signal(60.0, overrun):
    pass  # no signal: the block ends and puts the wakeup descriptor back
assert signal.set_wakeup_fd(-1) == -1
signal.signal(signal.SIGTERM, lambda *args: None)  # a handler that does nothing with it
with deadline_after_stop_signal(0.2, overrun):
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(30)
print("no deadline", flush=True)
"""

SIGNALLED_IN_A_DESTRUCTOR = """
import os, sys, time
from rlhf_cli.in_process import stop_in_order

class SignalledWhenDropped:
    def __del__(self):
        os.kill(os.getpid(), {signal_number})
        for _ in range(100_000):
            pass  # the handler runs here, and Python drops what it raises in a destructor

with stop_in_order(None):  # as `rlhf run` does, without a temporary server
    SignalledWhenDropped()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        pass
    print("the stop was lost", flush=True)
"""


@pytest.mark.parametrize(
    ("signal_number", "raised"), [(signal.SIGINT, KeyboardInterrupt), (signal.SIGTERM, SystemExit)]
)
def test_without_a_python_handler_sigint_interrupts_and_sigterm_exits(signal_number: int, raised: type) -> None:
    """A process started with SIGINT ignored (a shell's background job: `rlhf serve &`) has no Python handler
    to wrap; its SIGINT must still be the KeyboardInterrupt `rlhf serve` shuts down cleanly on (it used to
    leave by SystemExit(130) after the same shutdown), and the deadline must still start."""
    overran = threading.Event()
    handler = with_deadline(signal.SIG_IGN, 0.01, lambda number: overran.set())
    with pytest.raises(raised) as stop:
        handler(signal_number, None)
    assert raised is KeyboardInterrupt or stop.value.code == 128 + signal_number
    assert overran.wait(timeout=30)


def python(script: str, tmp_path: Path) -> subprocess.Popen:
    """`script` in a Python process of its own, in a process group of its own (which Prefect's temporary
    server joins), with a PREFECT_HOME of its own (and the temporary server's settings `rlhf run` gives it);
    stdout piped, stderr to `tmp_path/stderr.log` (a pipe could fill and stop it)."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("PREFECT_")}
    env |= TEMPORARY_SERVER_SETTINGS | {
        "PYTHONPATH": str(ROOT), "PREFECT_HOME": str(tmp_path / "prefect-home"), "PYTHONUNBUFFERED": "1"
    }  # fmt: skip
    with (tmp_path / "stderr.log").open("w") as stderr:
        return subprocess.Popen(
            [sys.executable, "-c", script],
            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=stderr, text=True, start_new_session=True,
        )  # fmt: skip


@pytest.mark.slow  # a Python process
def test_the_deadline_starts_at_a_signal_another_handler_takes(tmp_path: Path) -> None:
    process = python(SWALLOWED_SIGNAL, tmp_path)
    stdout, _ = process.communicate(timeout=60)
    stderr = (tmp_path / "stderr.log").read_text()
    assert (process.returncode, stdout) == (3, f"deadline after {int(signal.SIGTERM)}\n"), stderr[-2000:]


@pytest.mark.slow  # a flow run on Prefect's temporary server, in a process of its own
def test_sigterm_while_a_task_trains_in_a_thread_stops_the_command_within_10_s(tmp_path: Path) -> None:
    process = python(FLOW_WITH_A_TASK_IN_A_THREAD, tmp_path)
    started = time.monotonic()
    while process.stdout.readline() != "training\n":  # the task prints it, or the process ends (empty lines)
        stderr = (tmp_path / "stderr.log").read_text()
        assert process.poll() is None and time.monotonic() - started < START_DEADLINE_S, stderr[-3000:]
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=STOP_DEADLINE_S)
    except subprocess.TimeoutExpired:
        process.kill()
        pytest.fail(f"still running {STOP_DEADLINE_S} s after SIGTERM, its task thread training on")
    assert process.returncode == 128 + signal.SIGTERM
    assert "rlhf: stopped" in (tmp_path / "stderr.log").read_text()
    assert group_processes(process.pid) == []  # the temporary server too (it once stayed, re-parented to PID 1)


@pytest.mark.slow  # a Python process
@pytest.mark.parametrize("signal_number", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_raised_inside_a_destructor_is_raised_again(signal_number: int, tmp_path: Path) -> None:
    """The handler's exception, dropped by Python in a destructor (a garbage collector's callback in CI), must
    not lose the stop: it was lost, and `rlhf run` ended at its deadline with the flow run unmarked."""
    process = python(SIGNALLED_IN_A_DESTRUCTOR.format(signal_number=int(signal_number)), tmp_path)
    stdout, _ = process.communicate(timeout=60)
    stderr = (tmp_path / "stderr.log").read_text()
    assert (process.returncode, stdout) == (128 + signal_number, ""), stderr[-2000:]
    assert f"rlhf: stopped by {signal_number.name}" in stderr
