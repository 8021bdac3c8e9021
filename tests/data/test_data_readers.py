"""Reading rows from .jsonl, .jsonl.gz, .json, .parquet and the Hub; clear errors for unreadable inputs."""

from __future__ import annotations

import gzip
import hashlib
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlhf_core.data.readers import DataSourceError, HubDataset, RawRow, open_source
from rlhf_core.data.records import Drop, DropReason

ROWS = [{"prompt": f"question {index}", "chosen": "good", "rejected": "bad"} for index in range(5)]


def read_all(source: Path | HubDataset) -> list[RawRow | Drop]:
    return list(open_source(source).rows)


def write_jsonl_gz(path: Path, rows: list[dict]) -> None:
    with gzip.open(path, "wt", encoding="utf-8") as handle:
        handle.writelines(json.dumps(row) + "\n" for row in rows)


def test_jsonl_rows_carry_source_and_line_and_bad_lines_become_drops(tmp_path: Path) -> None:
    path = tmp_path / "pairs.jsonl"
    path.write_bytes(
        b'{"prompt": "a", "chosen": "b", "rejected": "c"}\n'
        b"\n"  # a blank line is not a row, but still counts as a line
        b"{not json\n"
        b"[1, 2]\n"
        b'"just a string"\n'
        b'{"prompt": "d", "chosen": "e", "rejected": "f"}'  # no final newline
    )
    items = read_all(path)
    assert [(type(item).__name__, item.line) for item in items] == [
        ("RawRow", 1),
        ("Drop", 3),
        ("Drop", 4),
        ("Drop", 5),
        ("RawRow", 6),
    ]
    assert all(item.source == "pairs.jsonl" for item in items)
    assert {item.reason for item in items if isinstance(item, Drop)} == {DropReason.MALFORMED_JSON}
    assert items[0].row == {"prompt": "a", "chosen": "b", "rejected": "c"}


def test_jsonl_gz_json_list_json_data_and_parquet_give_the_same_rows(tmp_path: Path) -> None:
    write_jsonl_gz(tmp_path / "a.jsonl.gz", ROWS)
    (tmp_path / "b.json").write_text(json.dumps(ROWS))
    (tmp_path / "c.json").write_text(json.dumps({"data": ROWS}))
    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "d.parquet")
    for name in ("a.jsonl.gz", "b.json", "c.json", "d.parquet"):
        items = read_all(tmp_path / name)
        assert [item.row for item in items] == ROWS, name
        assert [item.line for item in items] == [1, 2, 3, 4, 5], name


def test_content_hash_is_sha256_of_the_file_bytes(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl.gz"
    write_jsonl_gz(path, ROWS)
    assert open_source(path).sha256 == hashlib.sha256(path.read_bytes()).hexdigest()


def truncate(data: bytes) -> bytes:
    return data[: len(data) // 2]


def flip_bytes_in_the_compressed_stream(data: bytes) -> bytes:
    corrupted = bytearray(data)
    for index in range(200, 260):
        corrupted[index] ^= 0xFF
    return bytes(corrupted)


@pytest.mark.parametrize("damage", [truncate, flip_bytes_in_the_compressed_stream])
def test_damaged_gz_raises_naming_the_file_and_line(tmp_path: Path, damage) -> None:
    rows = [{"prompt": f"question number {index} " * 20, "chosen": str(index), "rejected": "x"} for index in range(400)]
    text = "".join(json.dumps(row) + "\n" for row in rows)
    path = tmp_path / "cut.jsonl.gz"
    path.write_bytes(damage(gzip.compress(text.encode(), mtime=0)))
    with pytest.raises(DataSourceError, match=r"cut\.jsonl\.gz is truncated or corrupt.*at line \d+"):
        read_all(path)


def test_file_that_is_not_gzip_raises(tmp_path: Path) -> None:
    path = tmp_path / "plain.jsonl.gz"
    path.write_text(json.dumps(ROWS[0]) + "\n")
    with pytest.raises(DataSourceError, match="plain.jsonl.gz is truncated or corrupt"):
        read_all(path)


@pytest.mark.parametrize("content", [b"", b"\n\n  \n"])
def test_empty_file_raises(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_bytes(content)
    with pytest.raises(DataSourceError, match=r"empty\.jsonl is empty"):
        read_all(path)


def test_missing_unsupported_and_invalid_inputs_raise_naming_them(tmp_path: Path) -> None:
    with pytest.raises(DataSourceError, match="input file not found: .*nowhere.jsonl"):
        open_source(tmp_path / "nowhere.jsonl")
    (tmp_path / "pairs.csv").write_text("a,b\n")
    with pytest.raises(DataSourceError, match=r"unsupported input file .*pairs\.csv.*\.jsonl"):
        open_source(tmp_path / "pairs.csv")
    (tmp_path / "broken.json").write_text('[{"a": 1},')
    with pytest.raises(DataSourceError, match=r"broken\.json is not valid JSON"):
        read_all(tmp_path / "broken.json")
    (tmp_path / "scalar.json").write_text('{"rows": []}')
    with pytest.raises(DataSourceError, match=r"scalar\.json: expected a JSON list"):
        read_all(tmp_path / "scalar.json")
    (tmp_path / "bad.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(DataSourceError, match=r"bad\.parquet is not a readable parquet file"):
        read_all(tmp_path / "bad.parquet")


LATIN_ROWS = [
    {"prompt": f"Café numéro {index}?", "chosen": "Oui, très bien.", "rejected": "Non."} for index in range(4)
]
LATIN_TEXT = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in LATIN_ROWS)
FIRST_ACCENT = LATIN_TEXT.encode("latin-1").index(b"\xe9")


@pytest.mark.parametrize(
    ("name", "data", "offset", "looks_like"),
    [
        ("latin1.jsonl", LATIN_TEXT.encode("latin-1"), FIRST_ACCENT, "Windows-1252 / Latin-1"),
        ("bom16.jsonl", LATIN_TEXT.encode("utf-16"), 0, "UTF-16-LE (it starts with that byte-order mark)"),
        ("plain16.jsonl", LATIN_TEXT.encode("utf-16-be"), 0, "UTF-16-BE"),
        ("wide32.json", json.dumps(LATIN_ROWS, ensure_ascii=False).encode("utf-32-le"), 1, "UTF-32-LE"),
        (
            "sjis.jsonl",
            json.dumps(
                {"prompt": "日本語の質問です", "chosen": "はい", "rejected": "いいえ"}, ensure_ascii=False
            ).encode("shift_jis")
            + b"\n",
            12,
            "a multi-byte legacy encoding",
        ),
    ],
)
def test_a_file_that_is_not_utf8_fails_naming_offset_and_encoding(
    tmp_path: Path, name: str, data: bytes, offset: int, looks_like: str
) -> None:
    """Not a row-level drop: in a Latin-1 file only the accented rows fail to decode, so dropping them
    would silently remove exactly the non-English rows."""
    path = tmp_path / name
    path.write_bytes(data)
    with pytest.raises(DataSourceError) as raised:
        read_all(path)
    message = str(raised.value)
    assert message.startswith(f"{path} is not UTF-8 text: ")
    assert f" at byte offset {offset} (line 1); the file looks like {looks_like}" in message
    assert "Convert it to UTF-8" in message


def test_a_gz_file_that_is_not_utf8_names_the_offset_in_the_decompressed_data(tmp_path: Path) -> None:
    path = tmp_path / "latin1.jsonl.gz"
    path.write_bytes(gzip.compress(("\n" + LATIN_TEXT).encode("latin-1")))
    with pytest.raises(
        DataSourceError,
        match=rf"byte 0xE9 is not valid UTF-8 at byte offset {FIRST_ACCENT + 1} "
        r"of the decompressed data \(line 2\); the file looks like Windows-1252",
    ):
        read_all(path)


def test_utf8_with_a_byte_order_mark_is_read(tmp_path: Path) -> None:
    path = tmp_path / "bom.jsonl"
    path.write_bytes(LATIN_TEXT.encode("utf-8-sig"))
    assert [item.row for item in read_all(path)] == LATIN_ROWS


def test_hub_failure_says_the_hub_could_not_be_reached_and_names_data_option(monkeypatch) -> None:
    datasets = pytest.importorskip("datasets")

    def offline(*args: object, **kwargs: object) -> None:
        raise ConnectionError("Couldn't reach 'Anthropic/hh-rlhf' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(DataSourceError) as error:
        open_source(HubDataset("Anthropic/hh-rlhf", split="test", data_dir="harmless-base"))
    message = str(error.value)
    assert "Anthropic/hh-rlhf/harmless-base[test]" in message
    assert "Hub could not be reached" in message
    assert "--data FILE" in message


def test_hub_rows_and_fingerprint_hash(monkeypatch) -> None:
    datasets = pytest.importorskip("datasets")
    loaded = datasets.Dataset.from_list(ROWS)
    calls = []

    def fake_load(name: str, data_dir: str | None = None, split: str | None = None) -> object:
        calls.append((name, data_dir, split))
        return loaded

    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    opened = open_source(HubDataset("Anthropic/hh-rlhf", split="train", data_dir="harmless-base"))
    assert calls == [("Anthropic/hh-rlhf", "harmless-base", "train")]
    assert opened.name == "Anthropic/hh-rlhf/harmless-base[train]"
    assert opened.sha256 == hashlib.sha256(loaded._fingerprint.encode()).hexdigest()
    items = list(opened.rows)
    assert [item.row for item in items] == ROWS
    assert [item.line for item in items] == [1, 2, 3, 4, 5]
