"""One writer per stage output: an exclusive lock on an output directory for the whole stage.

Why: two processes writing one output directory (two `rlhf sft --out X`, a CLI run beside a Prefect
task, `dvc repro` beside either) interleave their files, so `model/` comes from one run and
`history.params.json` from the other, and both exit 0. The entry points of prepare-data, sft,
train-rm, judge-rm, ppo, eval and score-pairs with an output directory (rlhf_core/stages; the CLI, the
Prefect tasks and `dvc repro` all call them, and a launched stage's rank 0 does) therefore hold this
lock from before they look at their output until its metrics.json is written; a second writer fails at
once with `OutputLockedError`, naming the holder's pid, host and start time. A stage that fails
because the output's file system is full or read-only fails with `OutputWriteError`, naming the output
(rlhf_core/write_failures.py).

How: `flock` on a sibling file, `.<name>.lock` next to the output directory. A sibling, because
prepare-data replaces its whole directory with a rename, and a file inside would enter the output's
content hash. The kernel drops an flock when its process dies, however it dies (SIGKILL included),
so a lock file a killed process left behind is free to take: the next writer takes it over at once,
and logs whose it was. No pid guessing is involved, so a reused pid can never keep a lock alive, and
a live holder can never be mistaken for a dead one. On NFS, Linux maps flock onto NFS byte-range
locks, which hold across machines.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

from rlhf_core.write_failures import naming_failed_writes

log = logging.getLogger(__name__)

HOLDER_BYTES = 4096  # far more than a holder record takes


class OutputLockedError(RuntimeError):
    """Another live process is writing the output directory."""


@dataclass(frozen=True)
class LockHolder:
    """Who holds (or last held) a lock: what the second writer's error names."""

    pid: int
    host: str
    started: str  # ISO 8601, UTC
    stage: str

    def describe(self) -> str:
        return f"pid {self.pid} on host {self.host} (stage {self.stage}, started {self.started})"


def lock_path(out_dir: Path) -> Path:
    """The lock file of `out_dir`: `.<name>.lock` beside it."""
    out_dir = Path(out_dir)
    return out_dir.parent / f".{out_dir.name}.lock"


@contextmanager
def output_lock(out_dir: Path, stage: str) -> Iterator[LockHolder]:
    """Hold the exclusive lock of `out_dir` while the block runs; raise `OutputLockedError` if it is taken.

    Not re-entrant: a second `output_lock` of the same directory in the same process fails like any
    other second writer.
    """
    path = lock_path(Path(out_dir))
    holder = LockHolder(
        pid=os.getpid(),
        host=socket.gethostname(),
        started=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        stage=stage,
    )
    with naming_failed_writes(out_dir):  # a full or read-only file system: one error naming the output
        path.parent.mkdir(parents=True, exist_ok=True)
        descriptor = _acquire(path, Path(out_dir))
    try:
        with naming_failed_writes(out_dir):  # the whole stage's writes: checkpoints, logs, outputs
            _write_holder(descriptor, holder)
            yield holder
    finally:
        # Removed while still locked: a process that opened the old file meanwhile notices that the
        # path no longer names it (`_acquire`) and locks the new one, so no two writers ever hold it.
        path.unlink(missing_ok=True)
        os.close(descriptor)


def _acquire(path: Path, out_dir: Path) -> int:
    """Lock `path` without waiting; the descriptor of the locked file, which is then the file at `path`."""
    while True:
        descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(descriptor)
            os.close(descriptor)
            raise OutputLockedError(_locked_message(out_dir, path, holder)) from None
        except BaseException:
            os.close(descriptor)
            raise
        if _names_this_file(path, descriptor):
            break
        os.close(descriptor)  # the holder finished and removed the file between our open and lock
    previous = _read_holder(descriptor)
    if previous is not None:
        log.warning(
            "%s: taking over the lock left by %s, which no longer runs (killed or crashed)",
            out_dir,
            previous.describe(),
        )
    return descriptor


def _names_this_file(path: Path, descriptor: int) -> bool:
    try:
        on_disk = os.stat(path)
    except FileNotFoundError:
        return False
    opened = os.fstat(descriptor)
    return (on_disk.st_dev, on_disk.st_ino) == (opened.st_dev, opened.st_ino)


def _locked_message(out_dir: Path, path: Path, holder: LockHolder | None) -> str:
    who = holder.describe() if holder is not None else "a process that is just starting"
    return (
        f"{out_dir} is being written by another process: {who}. Two writers would mix their outputs; "
        f"wait for it to finish (or stop it), or write elsewhere with another --out. Lock file: {path}"
    )


def _read_holder(descriptor: int) -> LockHolder | None:
    """The holder record in the lock file; None when it is empty or unreadable (a holder starting up)."""
    try:
        return LockHolder(**json.loads(os.pread(descriptor, HOLDER_BYTES, 0)))
    except (ValueError, TypeError):
        return None


def _write_holder(descriptor: int, holder: LockHolder) -> None:
    os.ftruncate(descriptor, 0)
    os.pwrite(descriptor, json.dumps(asdict(holder)).encode(), 0)
