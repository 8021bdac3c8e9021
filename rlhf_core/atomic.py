"""Atomic writes: an output directory (or file) is either complete or absent, never half-written.

Later stages, DVC and the caches treat an existing output directory as finished, so a crash or an error
half way through must never leave one behind, and must never damage the previous complete output.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def atomic_directory(out_dir: str | Path) -> Iterator[Path]:
    """Yield an empty temporary directory; on success it replaces `out_dir`, on any error it is removed.

    The temporary directory is a sibling of `out_dir` (same file system), so the final move is a rename.
    A directory cannot be renamed onto a non-empty one, so an existing output is first renamed aside, the
    new one renamed in, and only then the old one deleted; if the second rename fails the old output is
    put back.
    """
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    temp_dir = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    temp_dir.chmod(0o755)  # mkdtemp makes it owner-only; the result is an ordinary, shareable directory
    try:
        yield temp_dir
        _swap_into_place(temp_dir, out_dir)
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)  # already gone after a successful swap


def _swap_into_place(new_dir: Path, out_dir: Path) -> None:
    if not out_dir.exists():
        os.replace(new_dir, out_dir)
        return
    old_dir = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
    os.replace(out_dir, old_dir)
    try:
        os.replace(new_dir, out_dir)
    except OSError:
        os.replace(old_dir, out_dir)
        raise
    shutil.rmtree(old_dir)


def atomic_write_text(path: str | Path, text: str) -> Path:
    """Write `text` to `path` through a temporary file and `os.replace`: readers see the old or the new file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    temporary.write_text(text, encoding="utf-8")
    os.replace(temporary, path)
    return path
