"""An exclusive lock on a file that names its holder: the one lock helper of the project.

Two things use it: one writer per stage output (rlhf_core/output_lock.py, which fails at once when the
output is taken) and one training stage per machine without a Prefect server (tasks/execution/concurrency.py,
which waits for the slot). Both say who holds the lock, from the same record: the holder's pid, host,
start time and stage, written into the lock file (`LockHolder`).

How: `flock` on the file. The kernel drops an flock when its process dies, however it dies (SIGKILL
included), so a lock file a killed process left behind is free to take, and its record says whose it
was (`HeldLock.previous`). No pid guessing is involved, so a reused pid can never keep a lock alive, and
a live holder can never be mistaken for a dead one. The file is removed on release while still locked;
a process that opened it meanwhile sees that the path no longer names the file it locked and locks
the new one, so no two processes ever hold the lock. On NFS, Linux maps flock onto NFS byte-range locks,
which hold across machines.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType

HOLDER_BYTES = 4096  # far more than a holder record takes


@dataclass(frozen=True)
class LockHolder:
    """Who holds (or last held) a lock: what the messages about a taken lock name."""

    pid: int
    host: str
    started: str  # ISO 8601, UTC
    stage: str

    def describe(self) -> str:
        return f"pid {self.pid} on host {self.host} (stage {self.stage}, started {self.started})"


class LockTakenError(RuntimeError):
    """Another live process holds the lock; `holder` is its record (None: a holder just starting up)."""

    def __init__(self, path: Path, holder: LockHolder | None) -> None:
        super().__init__(f"{path} is locked by {holder.describe() if holder else 'a process just starting'}")
        self.path = path
        self.holder = holder


@dataclass
class HeldLock:
    """A lock this process holds, released (and its file removed) by `release` or at the end of a `with`."""

    path: Path
    descriptor: int
    holder: LockHolder  # this process's record, written into the file
    previous: LockHolder | None  # the record of a holder that died holding it (killed or crashed), if any

    def release(self) -> None:
        self.path.unlink(missing_ok=True)  # while still locked: see the module docstring
        os.close(self.descriptor)

    def __enter__(self) -> HeldLock:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.release()


def acquire_lock(path: Path, stage: str, wait: bool = False) -> HeldLock:
    """Lock `path` (created with its parents) for `stage` and write this process's record into it.

    wait=False raises `LockTakenError` at once when another process holds it; wait=True waits until it
    is free. Not re-entrant: a second lock of the same path in the same process is refused (or waits)
    like any other.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = read_holder(descriptor)
            os.close(descriptor)
            raise LockTakenError(path, holder) from None
        except BaseException:
            os.close(descriptor)
            raise
        if _names_this_file(path, descriptor):
            break
        os.close(descriptor)  # the holder released it and removed the file between our open and lock
    previous = read_holder(descriptor)
    holder = LockHolder(
        pid=os.getpid(), host=socket.gethostname(), started=datetime.now(UTC).isoformat(timespec="seconds"), stage=stage
    )
    try:
        write_holder(descriptor, holder)
    except BaseException:  # a full or read-only file system: leave no descriptor or lock file behind
        path.unlink(missing_ok=True)
        os.close(descriptor)
        raise
    return HeldLock(path, descriptor, holder, previous)


def write_holder(descriptor: int, holder: LockHolder) -> None:
    """Replace the record in an open lock file with `holder`'s."""
    os.ftruncate(descriptor, 0)
    os.pwrite(descriptor, json.dumps(asdict(holder)).encode(), 0)


def read_holder(descriptor: int) -> LockHolder | None:
    """The holder record in an open lock file; None when it is empty or unreadable (a holder starting up)."""
    try:
        return LockHolder(**json.loads(os.pread(descriptor, HOLDER_BYTES, 0)))
    except (ValueError, TypeError):
        return None


def _names_this_file(path: Path, descriptor: int) -> bool:
    try:
        on_disk = os.stat(path)
    except FileNotFoundError:
        return False
    opened = os.fstat(descriptor)
    return (on_disk.st_dev, on_disk.st_ino) == (opened.st_dev, opened.st_ino)
