"""Write a whole output directory atomically, and read/write the parquet files inside it.

Later stages (and DVC) treat an output directory with a data_report.json as finished. A crash or an
error half way through must therefore never leave such a directory behind, and must never damage the
previous complete output: everything is written into a temporary directory beside the target and moved
into place with os.replace only once it is complete.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

MESSAGE_TYPE = pa.struct([("role", pa.string()), ("content", pa.string())])
PROMPT_TYPE = pa.list_(MESSAGE_TYPE)


@contextmanager
def atomic_directory(out_dir: Path) -> Iterator[Path]:
    """Yield an empty temporary directory; on success it replaces `out_dir`, on failure it is removed.

    The temporary directory sits in the same parent so that os.replace is a rename on one file system.
    A directory cannot be renamed over a non-empty one, so an existing output is first renamed aside,
    the new one renamed in, and only then the old one deleted; if the second rename fails the old
    output is put back.
    """
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    temp_dir = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
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


def write_parquet(path: Path, rows: list[dict[str, object]], schema: pa.Schema) -> None:
    """Write rows (dicts keyed by the schema's column names) to one parquet file with a fixed schema.

    The schema is given explicitly so that an empty split still has the right columns and types.
    """
    table = pa.Table.from_pylist(rows, schema=schema)
    pq.write_table(table, path)


def read_parquet(path: Path) -> list[dict[str, Any]]:
    """Read a parquet file back as a list of dicts, one per row."""
    return pq.read_table(path).to_pylist()
