"""Stream raw rows, with where they came from, out of local files or a Hugging Face Hub dataset.

Supported inputs: `.jsonl`, `.jsonl.gz` (one JSON object a line), `.json` (a list of objects, or an
object whose "data" key holds that list), `.parquet`, and a Hub dataset loaded with
`datasets.load_dataset(name, data_dir=..., split=...)`.

Two kinds of failure are kept apart on purpose:
- a bad row (not JSON, not an object) is yielded as a malformed_json Drop: one bad line in 160k is data
  to report, not a reason to stop;
- an input that cannot be read at all (missing, unsupported, truncated or corrupt, empty, not UTF-8,
  Hub unreachable) raises DataSourceError naming it, because no report made from it could be trusted.

Text that is not UTF-8 is a property of the whole file, not of a row: in a Latin-1 file only the rows
with accented letters fail to decode, so dropping them as malformed would quietly remove exactly the
non-English rows. The first byte that is not UTF-8 (or a NUL byte, which no JSON text holds and every
UTF-16 or UTF-32 file does) stops the run, naming the file, the byte offset and the encoding the
file looks like.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import pyarrow as pa
import pyarrow.parquet as pq

from rlhf_core.data.records import Drop, DropReason

SUPPORTED_SUFFIXES = (".jsonl", ".jsonl.gz", ".json", ".parquet")
ENCODING_SAMPLE_BYTES = 1 << 16
# Accented letters are a few per word of Latin-script text; CJK legacy encodings make most bytes high.
MAX_LATIN_HIGH_BYTES_PER_WORD = 1.0
BYTE_ORDER_MARKS = (  # UTF-32 first: its little-endian mark begins with UTF-16's
    (b"\xff\xfe\x00\x00", "UTF-32-LE"),
    (b"\x00\x00\xfe\xff", "UTF-32-BE"),
    (b"\xff\xfe", "UTF-16-LE"),
    (b"\xfe\xff", "UTF-16-BE"),
)


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


def guess_encoding(sample: bytes) -> str:
    """What a text that is not UTF-8 looks like it is encoded in (for the error message, not for reading)."""
    for mark, name in BYTE_ORDER_MARKS:
        if sample.startswith(mark):
            return f"{name} (it starts with that byte-order mark)"
    if 0 in sample:  # ASCII in UTF-16 is one zero byte in two, in UTF-32 three in four
        zeros = [sample[start::4].count(0) for start in range(4)]
        if min(zeros[1], zeros[2]) > len(sample) / 8:
            return "UTF-32-LE" if zeros[3] > zeros[0] else "UTF-32-BE"
        return "UTF-16-LE" if zeros[1] + zeros[3] > zeros[0] + zeros[2] else "UTF-16-BE"
    high = sum(byte >= 0x80 for byte in sample)
    try:
        sample.decode("cp1252")
    except UnicodeDecodeError:
        high = len(sample)  # not Windows-1252 at all
    if high > MAX_LATIN_HIGH_BYTES_PER_WORD * len(sample.split()):
        return "a multi-byte legacy encoding (Shift_JIS, GBK, EUC-KR or similar)"
    return "Windows-1252 / Latin-1"


class _Utf8Lines:
    """Decodes a file's lines as UTF-8, raising DataSourceError at the first byte that is not UTF-8 text."""

    def __init__(self, path: Path, compressed: bool) -> None:
        self.path = path
        self.compressed = compressed  # offsets count the decompressed bytes
        self.offset = 0  # of the next line, in bytes from the start

    def decode(self, raw: bytes, line: int) -> str:
        start, self.offset = self.offset, self.offset + len(raw)
        nul = raw.find(b"\x00")
        try:
            text = raw.decode("utf-8-sig" if start == 0 else "utf-8")
        except UnicodeDecodeError as error:
            if not 0 <= nul < error.start:
                self._fail(start + error.start, line, f"byte 0x{raw[error.start]:02X} is not valid UTF-8")
            text = ""
        if nul >= 0:
            self._fail(start + nul, line, "a NUL byte (no JSON text holds one)")
        return text

    def _fail(self, offset: int, line: int, what: str) -> NoReturn:
        encoding = guess_encoding(self._sample())
        where = " of the decompressed data" if self.compressed else ""
        raise DataSourceError(
            f"{self.path} is not UTF-8 text: {what} at byte offset {offset}{where} (line {line}); the file "
            f"looks like {encoding}. Convert it to UTF-8 (e.g. `iconv -f <encoding> -t UTF-8`) and rerun."
        )

    def _sample(self) -> bytes:
        opener = gzip.open if self.compressed else open
        with opener(self.path, "rb") as handle:
            return handle.read(ENCODING_SAMPLE_BYTES)


def _decode_line(text: str, source: str, line: int) -> RawRow | Drop:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        return Drop(reason=DropReason.MALFORMED_JSON, detail=f"not valid JSON: {error}", source=source, line=line)
    return _object_or_drop(value, source, line)


def _jsonl_rows(path: Path) -> Iterator[RawRow | Drop]:
    lines = _Utf8Lines(path, compressed=False)
    with path.open("rb") as handle:
        for number, raw in enumerate(handle, start=1):
            text = lines.decode(raw, number)
            if text.strip():  # blank lines (a trailing newline, say) are not rows
                yield _decode_line(text, path.name, number)


def _jsonl_gz_rows(path: Path) -> Iterator[RawRow | Drop]:
    lines_read = 0
    lines = _Utf8Lines(path, compressed=True)
    try:
        with gzip.open(path, "rb") as handle:
            for lines_read, raw in enumerate(handle, start=1):
                text = lines.decode(raw, lines_read)
                if text.strip():
                    yield _decode_line(text, path.name, lines_read)
    except (EOFError, gzip.BadGzipFile, zlib.error) as error:
        raise DataSourceError(
            f"{path} is truncated or corrupt: decompression failed at line {lines_read + 1} "
            f"({lines_read} complete lines read before it: {error}). "
            "Re-download or re-create the file."
        ) from error


def _json_rows(path: Path) -> Iterator[RawRow | Drop]:
    lines = _Utf8Lines(path, compressed=False)
    text = "".join(
        lines.decode(raw, number) for number, raw in enumerate(path.read_bytes().splitlines(keepends=True), start=1)
    )
    try:
        document = json.loads(text)
    except json.JSONDecodeError as error:
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
