"""A bounded stop on SIGINT and SIGTERM, shared by the commands that run flows in this process.

`rlhf serve` (flows/serving.py) and `rlhf run` / `rlhf ablate` (rlhf_cli/in_process.py) both stop in an
orderly way when signalled: the signal becomes an exception (or Prefect's graceful shutdown), so that
`finally` blocks run, the flow run is marked, and the servers and processes the command started are
stopped. An orderly stop waits on other processes (the Prefect API, a server's shutdown), so each
command also starts a deadline at the first signal (`with_deadline`, or `deadline_after_stop_signal`
where Prefect's flow engine may take the signal first): past it, the command stops what it started
outright, says so in one line and exits. A stop that finishes in time leaves through
`exit_without_teardown`, which skips the interpreter's slow teardown. A stop exception that Python swallowed
(raised by the handler inside a destructor) sends its signal again (`redeliver_swallowed_stops`).
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any, NoReturn

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)

REDELIVERY_DELAY_S = 0.05  # for the main thread to have left the hook that resends a swallowed stop

SignalHandler = Callable[[int, FrameType | None], Any]


def with_deadline(previous: SignalHandler | int | None, grace_s: float, overrun: Callable[[int], Any]) -> SignalHandler:
    """A handler that starts the deadline, then does what `previous` did; a second signal does not
    restart it. `overrun(signal_number)` runs `grace_s` after the first signal, on a timer thread,
    unless the process has exited by then: it must end the process.

    Where `previous` is no Python handler, SIGINT raises KeyboardInterrupt, as Python's own handler does:
    a process started with SIGINT ignored (a shell's background job) has no handler of Python's, and
    leaving by SystemExit would skip the commands' clean-shutdown path."""
    deadline_started = threading.Event()

    def handle(signal_number: int, frame: FrameType | None) -> None:
        if not deadline_started.is_set():
            deadline_started.set()
            timer = threading.Timer(grace_s, overrun, args=(signal_number,))
            timer.daemon = True
            timer.start()
        if callable(previous):
            previous(signal_number, frame)
        elif signal_number == signal.SIGINT:
            raise KeyboardInterrupt
        else:
            sys.exit(128 + signal_number)

    return handle


@contextmanager
def deadline_after_stop_signal(grace_s: float, overrun: Callable[[int], Any]) -> Iterator[None]:
    """Within the block, `overrun(signal_number)` runs on a timer thread `grace_s` after the first SIGINT or
    SIGTERM, whichever Python handler takes the signal; it must end the process.

    A handler of our own is not enough: during a flow run Prefect's engine installs its own SIGTERM handler,
    and calls the one before it only once the flow's task threads have ended (an ablation's PPO stage trains
    on in one for an hour). So the signal is seen where the interpreter's C handler writes it, the wakeup
    file descriptor (`signal.set_wakeup_fd`), by a watcher thread.
    """
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    previous_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)

    def watch() -> None:
        while data := os.read(read_fd, 64):  # empty once the block has ended and closed the pipe
            stop = next((number for number in data if number in STOP_SIGNALS), None)
            if stop is not None:
                timer = threading.Timer(grace_s, overrun, args=(stop,))
                timer.daemon = True
                timer.start()
                return

    watcher = threading.Thread(target=watch, name="rlhf-stop-deadline", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        signal.set_wakeup_fd(previous_fd)
        os.close(write_fd)
        watcher.join()
        os.close(read_fd)


@contextmanager
def redeliver_swallowed_stops(on_swallowed: Callable[[], Any] = lambda: None) -> Iterator[None]:
    """Within the block, a stop exception that Python swallowed sends its signal again.

    A signal's Python handler runs wherever the main thread is at that moment. When that is a destructor or a
    garbage collector's weakref callback (SQLAlchemy registers them), the exception it raises is printed as
    "Exception ignored in ..." and dropped: the stop was lost, the command trained on, and `rlhf run` ended
    at its deadline with the flow run still Running (what failed a CI run). Python hands every such exception to
    `sys.unraisablehook`; here that hook calls `on_swallowed` (for a handler that ignores repeats) and has a
    timer thread send the signal again REDELIVERY_DELAY_S later, so the handler raises once more where the
    main thread has gone by then (sent from the hook itself, it raised inside the hook, dropped again)."""
    previous = sys.unraisablehook

    def hook(unraisable: Any) -> None:
        number = stop_signal(unraisable.exc_value) if unraisable.exc_value is not None else None
        if number is None:
            previous(unraisable)
            return
        on_swallowed()
        resend = threading.Timer(REDELIVERY_DELAY_S, os.kill, args=(os.getpid(), number))
        resend.daemon = True
        resend.start()

    sys.unraisablehook = hook
    try:
        yield
    finally:
        sys.unraisablehook = previous


def exit_without_teardown(status: int) -> NoReturn:
    """Run the exit handlers (Prefect's log and event workers send what they hold there, and stop its
    temporary server) and exit with `status`, skipping the interpreter's teardown of torch, MLflow and
    Prefect: that alone took about 3 s on a loaded 2-core machine."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def signal_name(signal_number: int) -> str:
    """`SIGTERM` for 15, and so on."""
    return signal.Signals(signal_number).name


def stop_signal(error: BaseException) -> int | None:
    """The signal a stop exception stands for: SIGINT for KeyboardInterrupt, a TerminationSignal's own
    (Prefect raises it for SIGTERM in a flow run); None for any other error."""
    from prefect.exceptions import TerminationSignal

    if isinstance(error, KeyboardInterrupt):
        return signal.SIGINT
    if isinstance(error, TerminationSignal):
        return error.signal
    return None
