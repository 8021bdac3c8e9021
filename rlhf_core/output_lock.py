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

How: the file lock of rlhf_core/file_lock.py on a sibling file, `.<name>.lock` next to the output
directory. A sibling, because prepare-data replaces its whole directory with a rename, and a file inside
would enter the output's content hash. A lock file a killed process left behind is free to take: the
next writer takes it over at once, and logs whose it was.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from rlhf_core.file_lock import LockHolder, LockTakenError, acquire_lock
from rlhf_core.write_failures import naming_failed_writes

log = logging.getLogger(__name__)


class OutputLockedError(RuntimeError):
    """Another live process is writing the output directory."""


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
    try:
        with naming_failed_writes(out_dir):  # a full or read-only file system: one error naming the output
            lock = acquire_lock(path, stage)
    except LockTakenError as taken:
        raise OutputLockedError(_locked_message(Path(out_dir), path, taken.holder)) from None
    if lock.previous is not None:
        log.warning(
            "%s: taking over the lock left by %s, which no longer runs (killed or crashed)",
            out_dir,
            lock.previous.describe(),
        )
    with lock, naming_failed_writes(out_dir):  # the whole stage's writes: checkpoints, logs, outputs
        yield lock.holder


def _locked_message(out_dir: Path, path: Path, holder: LockHolder | None) -> str:
    who = holder.describe() if holder is not None else "a process that is just starting"
    return (
        f"{out_dir} is being written by another process: {who}. Two writers would mix their outputs; "
        f"wait for it to finish (or stop it), or write elsewhere with another --out. Lock file: {path}"
    )
