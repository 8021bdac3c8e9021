"""Atomic writes: an output directory (or file) is either complete or absent, never half-written.

Later stages, DVC and the caches treat an existing output directory as finished, so a crash or an error
half way through must never leave one behind, and must never damage the previous complete output.

A process killed mid-write cannot clean up after itself, so its temporary siblings carry its host and
pid in their names (`.<name>.tmp-<host>-<pid>-<random>`, `.<name>.old-...`), and the next atomic write of
the same directory or file removes those whose process no longer runs (`remove_stale_temporaries`).

A write that fails because the file system is full or read-only raises `OutputWriteError` naming the
output (rlhf_core/write_failures.py), checked before the cleanup frees the space the write took.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from rlhf_core.write_failures import naming_failed_writes

TEMPORARY = "tmp"  # the new output being written
ASIDE = "old"  # the previous output, renamed aside during the swap


@contextmanager
def atomic_directory(out_dir: str | Path) -> Iterator[Path]:
    """Yield an empty temporary directory; on success it replaces `out_dir`, on any error it is removed.

    The temporary directory is a sibling of `out_dir` (same file system), so the final move is a rename.
    A directory cannot be renamed onto a non-empty one, so an existing output is first renamed aside, the
    new one renamed in, and only then the old one deleted; if the second rename fails the old output is
    put back.
    """
    out_dir = Path(out_dir)
    with naming_failed_writes(out_dir):
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(out_dir)
        temp_dir = Path(tempfile.mkdtemp(prefix=_sibling_prefix(out_dir, TEMPORARY), dir=out_dir.parent))
        temp_dir.chmod(0o755)  # mkdtemp makes it owner-only; the result is an ordinary, shareable directory
    try:
        with naming_failed_writes(out_dir):  # inside the cleanup, which frees what a failed write took
            yield temp_dir
            _swap_into_place(temp_dir, out_dir)
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)  # already gone after a successful swap


def _swap_into_place(new_dir: Path, out_dir: Path) -> None:
    if not out_dir.exists():
        os.replace(new_dir, out_dir)
        return
    old_dir = Path(tempfile.mkdtemp(prefix=_sibling_prefix(out_dir, ASIDE), dir=out_dir.parent))
    os.replace(out_dir, old_dir)
    try:
        os.replace(new_dir, out_dir)
    except OSError:
        os.replace(old_dir, out_dir)
        raise
    shutil.rmtree(old_dir)


def _sibling_prefix(out_dir: Path, kind: str) -> str:
    """`.<name>.<kind>-<host>-<pid>-`: whose temporary directory it is, for `remove_stale_temporaries`."""
    return f".{out_dir.name}.{kind}-{socket.gethostname()}-{os.getpid()}-"


def remove_stale_temporaries(out_dir: str | Path) -> None:
    """Remove the temporary siblings of `out_dir` whose writer, a process on this host, no longer runs.

    `out_dir` may be a directory (`atomic_directory`) or a file (`atomic_file`). A previous output set
    aside by a swap that was killed half way is put back when `out_dir` is missing (the swap got no
    further), so finished work is never lost; otherwise it is removed. Temporaries of other hosts are
    left alone: their pids mean nothing here.
    """
    out_dir = Path(out_dir)
    pattern = re.compile(
        rf"^\.{re.escape(out_dir.name)}\.(?P<kind>{TEMPORARY}|{ASIDE})-(?P<host>.+)-(?P<pid>\d+)-[a-z0-9_]+$"
    )
    host = socket.gethostname()
    stale: dict[str, list[Path]] = {TEMPORARY: [], ASIDE: []}
    for sibling in sorted(out_dir.parent.iterdir()):
        match = pattern.match(sibling.name)
        if match and match["host"] == host and not _process_runs(int(match["pid"])):
            stale[match["kind"]].append(sibling)
    for aside in stale[ASIDE]:  # only directories are set aside (`_swap_into_place`)
        if aside.is_dir() and not out_dir.exists():
            os.replace(aside, out_dir)
        else:
            _remove(aside)
    for temporary in stale[TEMPORARY]:
        _remove(temporary)


def _remove(path: Path) -> None:
    """Delete a file or a directory tree; one already gone (another cleaner was first) is fine."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _process_runs(pid: int) -> bool:
    """Whether process `pid` exists on this host (one of another user counts as running)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextmanager
def atomic_file(path: str | Path) -> Iterator[Path]:
    """Yield a temporary sibling path to write; on success it replaces `path` (`os.replace`), on error it goes.

    Readers see the old file or the new one, never a part. The temporary file is named like a temporary
    directory (`.<name>.tmp-<host>-<pid>-<random>`), so one a killed writer left is removed by the next
    atomic write of `path`.
    """
    path = Path(path)
    with naming_failed_writes(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(path)
        descriptor, name = tempfile.mkstemp(prefix=_sibling_prefix(path, TEMPORARY), dir=path.parent)
        os.fchmod(descriptor, 0o644)  # mkstemp makes it owner-only; the result is an ordinary, shareable file
        os.close(descriptor)
    temporary = Path(name)
    try:
        with naming_failed_writes(path):
            yield temporary
            os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)  # already renamed away on success


def atomic_write_text(path: str | Path, text: str) -> Path:
    """Write `text` to `path` atomically (`atomic_file`): readers see the old or the new file."""
    with atomic_file(path) as temporary:
        temporary.write_text(text, encoding="utf-8")
    return Path(path)
