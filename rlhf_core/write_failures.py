"""Writes that fail because the file system is full, read-only or not ours: one error naming the output.

Why: a full disk reaches the user as whatever the writing library says. safetensors says "Error while
serializing: I/O error: No space left on device (os error 28)", torch's zip writer "[enforce fail at
inline_container.cc:672] . unexpected pos 13568 vs 13460", `os.write` "[Errno 28] No space left on
device"; none names the path, and torch does not even name the cause. `OutputWriteError` says "cannot
write <output>: no space left on device" instead (or "read-only file system", "permission denied",
"disk quota exceeded"), and the CLI prints it as its one error line (rlhf_cli/main.py).

How: `naming_failed_writes(path)` turns an error raised inside it into `OutputWriteError(path)` when
`write_failure` blames the file system: an `OSError` with one of WRITE_FAILURES' errnos anywhere in the
error's chain (EACCES only for the output's own paths: an unreadable input is not the output's fault); else the C error
text of one in its message (safetensors); else, for a `RuntimeError` or
`OSError` that carries neither (torch's writer), the state of `path`'s file system: mounted read-only,
or less than FULL_BELOW_BYTES left. Other errors pass unchanged. The atomic writers (rlhf_core/atomic.py)
check before their cleanup frees the space a failed write took, and every stage's output lock
(rlhf_core/output_lock.py) around the whole stage, so checkpoints and logs are covered too.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

# errno -> the reason as the error line gives it
WRITE_FAILURES = {
    errno.ENOSPC: "no space left on device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied",
}
# The C library's words for the errnos only a file system gives, as libraries that do not raise OSError
# quote them ("permission denied" is left out: a server's refusal says it too).
ERROR_TEXTS = {os.strerror(code).lower(): code for code in (errno.ENOSPC, errno.EDQUOT, errno.EROFS)}
# Free space under which a writer's own unexplained failure counts as a full disk: a failed write
# fills the file system to its last block, and no model or checkpoint file is this small.
FULL_BELOW_BYTES = 64 * 1024


class OutputWriteError(OSError):
    """Writing under `filename` failed because of its file system (`strerror` says how)."""

    def __init__(self, path: str | Path, code: int) -> None:
        super().__init__(code, WRITE_FAILURES[code], str(path))

    def __str__(self) -> str:
        return f"cannot write {self.filename}: {self.strerror}"

    def __repr__(self) -> str:  # what Prefect's "Task run failed with exception" shows: the path too
        return f"{type(self).__name__}({str(self)!r})"


@contextmanager
def naming_failed_writes(path: str | Path) -> Iterator[None]:
    """Raise `OutputWriteError(path)` for an error of the block that `write_failure` blames on the file
    system (chained to it, for RLHF_DEBUG's traceback); let every other error through unchanged."""
    try:
        yield
    except OutputWriteError:
        raise  # an inner writer already named its path
    except Exception as error:
        code = write_failure(error, Path(path))
        if code is None:
            raise
        raise OutputWriteError(path, code) from error


def write_failure(error: BaseException, path: Path) -> int | None:
    """The errno (a key of WRITE_FAILURES) that explains `error`, raised writing under `path`, or None."""
    chain = error_chain(error)
    for cause in chain:
        if isinstance(cause, OSError) and cause.errno in WRITE_FAILURES:
            if cause.errno != errno.EACCES or _concerns(cause.filename, path):
                return cause.errno
    for cause in chain:
        text = str(cause).lower()
        for words, code in ERROR_TEXTS.items():
            if words in text:
                return code
    if any(isinstance(cause, (RuntimeError, OSError)) for cause in chain):
        return file_system_failure(path)
    return None


def file_system_failure(path: Path) -> int | None:
    """EROFS when `path`'s file system (that of its nearest existing ancestor) is mounted read-only,
    ENOSPC when it has less than FULL_BELOW_BYTES free for us, else None."""
    existing = Path(os.path.abspath(path))
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    stats = os.statvfs(existing)
    if stats.f_flag & os.ST_RDONLY:
        return errno.EROFS
    free = (stats.f_bfree if os.geteuid() == 0 else stats.f_bavail) * stats.f_frsize
    return errno.ENOSPC if free < FULL_BELOW_BYTES else None


def _concerns(filename: object, path: Path) -> bool:
    """Whether `filename` (of a refused access) is `path`, inside it, a directory made for it, or a sibling
    of its own (`.<name>.lock`, `.<name>.tmp-...`): an input that may not be read is not the output's fault."""
    if not isinstance(filename, (str, Path)):
        return False
    target, path = Path(os.path.abspath(filename)), Path(os.path.abspath(path))
    sibling = target.parent == path.parent and target.name.startswith(f".{path.name}.")
    return target == path or path in target.parents or target in path.parents or sibling


def error_chain(error: BaseException) -> list[BaseException]:
    """`error` and the errors it was raised from or during, innermost last (each once)."""
    chain: list[BaseException] = []
    current: BaseException | None = error
    while current is not None and current not in chain:
        chain.append(current)
        current = current.__cause__ or current.__context__
    return chain
