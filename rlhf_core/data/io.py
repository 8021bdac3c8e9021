"""Read and write the parquet files of a prepared-data directory (written whole by rlhf_core.atomic)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

MESSAGE_TYPE = pa.struct([("role", pa.string()), ("content", pa.string())])
PROMPT_TYPE = pa.list_(MESSAGE_TYPE)


def write_parquet(path: Path, rows: list[dict[str, object]], schema: pa.Schema) -> None:
    """Write rows (dicts keyed by the schema's column names) to one parquet file with a fixed schema.

    The schema is given explicitly so that an empty split still has the right columns and types.
    """
    table = pa.Table.from_pylist(rows, schema=schema)
    pq.write_table(table, path)


def read_parquet(path: Path) -> list[dict[str, Any]]:
    """Read a parquet file back as a list of dicts, one per row."""
    return pq.read_table(path).to_pylist()
