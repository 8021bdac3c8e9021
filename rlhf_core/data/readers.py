"""Stream raw rows, with where they came from, out of local files or a Hugging Face Hub dataset.

Supported inputs: `.jsonl`, `.jsonl.gz` (one JSON object a line), `.json` (a list of objects, or an
object whose "data" key holds that list), `.parquet`, and a Hub dataset loaded with
`datasets.load_dataset(name, data_dir=..., split=...)`.

Two kinds of failure are kept apart on purpose:
- a bad row (not JSON, not an object) is yielded as a malformed_json Drop: one bad line in 160k is data
  to report, not a reason to stop;
- an input that cannot be read at all (missing, unsupported, truncated or corrupt, empty, Hub
  unreachable) raises DataSourceError naming it, because no report made from it could be trusted.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from rlhf_core.data.records import Drop, DropReason

SUPPORTED_SUFFIXES = (".jsonl", ".jsonl.gz", ".json", ".parquet")


class DataSourceError(Exception):
    """An input could not be read at all: missing, unsupported, truncated, corrupt, empty or unreachable."""


@dataclass(frozen=True)
class HubDataset:
    """A dataset on the Hugging Face Hub, e.g. HubDataset("Anthropic/hh-rlhf", "train", "harmless-base")."""

    name: str
    split: str = "train"
    data_dir: str | None = None

    @property
    def label(self) -> str:
        """How pairs from this dataset name their source, e.g. "Anthropic/hh-rlhf/harmless-base[train]"."""
        location = f"{self.name}/{self.data_dir}" if self.data_dir else self.name
        return f"{location}[{self.split}]"


Source = Path | HubDataset


@dataclass(frozen=True)
class RawRow:
    """One decoded JSON object and where it was: `line` is 1-based (a file line, or a record number)."""

    row: dict[str, object]
    source: str
    line: int


@dataclass(frozen=True)
class OpenedSource:
    """An input ready to stream: its name, a content hash for the report, and its rows (read lazily)."""

    name: str
    sha256: str
    rows: Iterator[RawRow | Drop]


def open_source(source: Source) -> OpenedSource:
    """Open a local file or a Hub dataset; raises DataSourceError when it cannot be read.

    The returned rows iterator may itself raise DataSourceError part-way (a truncated .gz, say), so
    callers must read it completely before writing anything that looks finished.
    """
    if isinstance(source, HubDataset):
        return _open_hub(source)
    return _open_local(Path(source))


def _open_local(path: Path) -> OpenedSource:
    if not path.exists():
        raise DataSourceError(f"input file not found: {path}")
    if not path.is_file():
        raise DataSourceError(f"input path is not a file: {path}")
    name = path.name
    if name.endswith(".jsonl.gz"):
        rows = _jsonl_gz_rows(path)
    elif name.endswith(".jsonl"):
        rows = _jsonl_rows(path)
    elif name.endswith(".json"):
        rows = _json_rows(path)
    elif name.endswith(".parquet"):
        rows = _parquet_rows(path)
    else:
        raise DataSourceError(
            f"unsupported input file {path}: expected a name ending in one of {', '.join(SUPPORTED_SUFFIXES)}"
        )
    return OpenedSource(name=name, sha256=_file_sha256(path), rows=_require_rows(rows, str(path)))


def _open_hub(dataset: HubDataset) -> OpenedSource:
    # Imported here, not at module level: `datasets` is slow to import and only Hub inputs need it.
    import datasets

    try:
        loaded = datasets.load_dataset(dataset.name, data_dir=dataset.data_dir, split=dataset.split)
    except Exception as error:  # offline, unknown id, unknown split: all mean "could not load it"
        raise DataSourceError(
            f"could not load {dataset.label} from the Hugging Face Hub: the Hub could not be reached or "
            f"the dataset is unavailable ({type(error).__name__}: {error}). On a machine without internet "
            f"access, download the data elsewhere and pass the local file with --data FILE "
            f"({', '.join(SUPPORTED_SUFFIXES)})."
        ) from error
    # The fingerprint is the `datasets` library's hash of the data and the transforms applied to it.
    fingerprint = hashlib.sha256(loaded._fingerprint.encode("utf-8")).hexdigest()
    rows = (_object_or_drop(row, dataset.label, number) for number, row in enumerate(loaded, start=1))
    return OpenedSource(name=dataset.label, sha256=fingerprint, rows=_require_rows(rows, dataset.label))


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _require_rows(rows: Iterable[RawRow | Drop], label: str) -> Iterator[RawRow | Drop]:
    """Pass rows through, raising DataSourceError at the end if there were none (an empty input)."""
    count = 0
    for item in rows:
        count += 1
        yield item
    if count == 0:
        raise DataSourceError(f"input {label} is empty: it contains no rows")


def _object_or_drop(value: object, source: str, line: int) -> RawRow | Drop:
    if not isinstance(value, dict):
        return Drop(
            reason=DropReason.MALFORMED_JSON,
            detail=f"expected a JSON object, found {type(value).__name__}",
            source=source,
            line=line,
        )
    return RawRow(row=value, source=source, line=line)


def _decode_line(raw: bytes, source: str, line: int) -> RawRow | Drop:
    try:
        value = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        return Drop(reason=DropReason.MALFORMED_JSON, detail=f"not valid JSON: {error}", source=source, line=line)
    return _object_or_drop(value, source, line)


def _jsonl_rows(path: Path) -> Iterator[RawRow | Drop]:
    with path.open("rb") as handle:
        for number, raw in enumerate(handle, start=1):
            if raw.strip():  # blank lines (a trailing newline, say) are not rows
                yield _decode_line(raw, path.name, number)


def _jsonl_gz_rows(path: Path) -> Iterator[RawRow | Drop]:
    lines_read = 0
    try:
        with gzip.open(path, "rb") as handle:
            for lines_read, raw in enumerate(handle, start=1):
                if raw.strip():
                    yield _decode_line(raw, path.name, lines_read)
    except (EOFError, gzip.BadGzipFile, zlib.error) as error:
        raise DataSourceError(
            f"{path} is truncated or corrupt: decompression failed at line {lines_read + 1} "
            f"({lines_read} complete lines read before it: {error}). "
            "Re-download or re-create the file."
        ) from error


def _json_rows(path: Path) -> Iterator[RawRow | Drop]:
    try:
        document = json.loads(path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise DataSourceError(f"{path} is not valid JSON: {error}") from error
    records = document.get("data") if isinstance(document, dict) else document
    if not isinstance(records, list):
        raise DataSourceError(f"{path}: expected a JSON list of objects, or an object with a 'data' list")
    for number, value in enumerate(records, start=1):
        yield _object_or_drop(value, path.name, number)


def _parquet_rows(path: Path) -> Iterator[RawRow | Drop]:
    try:
        parquet_file = pq.ParquetFile(path)
        batches = parquet_file.iter_batches(batch_size=4096)
        number = 0
        for batch in batches:
            for value in batch.to_pylist():
                number += 1
                yield RawRow(row=value, source=path.name, line=number)
    except (pa.ArrowException, OSError) as error:
        raise DataSourceError(f"{path} is not a readable parquet file: {error}") from error
