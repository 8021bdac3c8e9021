"""End to end: files with every kind of bad row -> exact drop counts, outputs, report, atomic writes."""

from __future__ import annotations

import gzip
import hashlib
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fixtures.pairs import hh, word_lengths
from rlhf_core.atomic import atomic_directory
from rlhf_core.config import DataConfig
from rlhf_core.data.prepare import (
    FailedDataReport,
    failed_report_path,
    load_report,
    load_split,
    prepare_preference_data,
)
from rlhf_core.data.readers import DataSourceError
from rlhf_core.data.records import PreferencePair
from rlhf_core.data.validation import DataValidationError
from rlhf_core.layout import DATA_REPORT_FILE

OUTPUT_FILES = {
    "rm_train.parquet",
    "rm_val.parquet",
    "eval.parquet",
    "sft.parquet",
    "ppo_prompts.parquet",
    "ppo_val_prompts.parquet",
    "ppo_pairs.parquet",
    DATA_REPORT_FILE,
    "metrics.json",
}


def good_hh(number: int) -> dict:
    shared = [("Human", f"Question {number}?"), ("Assistant", "Which part?"), ("Human", "All of it.")]
    return {
        "chosen": hh(*shared, ("Assistant", f"Helpful answer {number}.")),
        "rejected": hh(*shared, ("Assistant", f"Unhelpful answer {number}.")),
    }


def good_pcr(number: int) -> dict:
    return {"prompt": f"Prompt number {number}", "chosen": f"Yes {number}", "rejected": f"No {number}"}


SETTINGS = DataConfig(
    eval_fraction=0.2, rm_val_fraction=0.2, ppo_fraction=0.2, max_total_tokens=40, max_drop_fraction=0.9
)

# (row as a JSON line, expected reason or None when the row is kept)
BAD_AND_GOOD_LINES: list[tuple[str, str | None]] = [
    (json.dumps(good_hh(1)), None),
    (json.dumps(good_pcr(2)), None),
    ("{not json", "malformed_json"),
    ("[1, 2, 3]", "malformed_json"),
    (json.dumps({"chosen": good_hh(3)["chosen"]}), "missing_field"),
    (json.dumps({"question": "hi"}), "missing_field"),
    (
        json.dumps(
            {"chosen": hh(("Human", "q"), ("Assistant", "")), "rejected": hh(("Human", "q"), ("Assistant", "b"))}
        ),
        "empty_reply",
    ),
    (json.dumps({"prompt": "p", "chosen": " ", "rejected": "b"}), "empty_reply"),
    (
        json.dumps(
            {"chosen": hh(("Human", "q"), ("Assistant", "same")), "rejected": hh(("Human", "q"), ("Assistant", "same"))}
        ),
        "identical_replies",
    ),
    (
        json.dumps(
            {"chosen": hh(("Human", "q1"), ("Assistant", "a")), "rejected": hh(("Human", "q2"), ("Assistant", "b"))}
        ),
        "prompt_mismatch",
    ),
    (
        json.dumps(
            {
                "chosen": hh(("Human", "q"), ("Human", "q"), ("Assistant", "a")),
                "rejected": hh(("Human", "q"), ("Human", "q"), ("Assistant", "b")),
            }
        ),
        "malformed_turns",
    ),
    (
        json.dumps(
            {
                "chosen": "intro" + hh(("Human", "q"), ("Assistant", "a")),
                "rejected": "intro" + hh(("Human", "q"), ("Assistant", "b")),
            }
        ),
        "malformed_turns",
    ),
    (
        json.dumps(
            {
                "chosen": hh(("Human", "q"), ("Assistant", "a"), ("Human", "ok")),
                "rejected": hh(("Human", "q"), ("Assistant", "a"), ("Human", "no")),
            }
        ),
        "malformed_turns",
    ),
    (json.dumps({"prompt": "short", "chosen": "word " * 45, "rejected": "no"}), "too_long"),
    (json.dumps(good_hh(1)), "duplicate_pair"),
    (json.dumps(good_pcr(2)), "duplicate_pair"),
    *[(json.dumps(good_hh(number)), None) for number in range(10, 16)],
]
EXPECTED_COUNTS = {
    "malformed_json": 2,
    "missing_field": 2,
    "empty_reply": 2,
    "identical_replies": 1,
    "prompt_mismatch": 1,
    "malformed_turns": 3,
    "too_long": 1,
    "duplicate_pair": 2,
}


def write_jsonl(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def drop_counts(report) -> dict[str, int]:
    return {reason: summary.count for reason, summary in report.drops.items() if summary.count}


def no_report_anywhere(root: Path) -> bool:
    return not list(root.rglob(DATA_REPORT_FILE))


def test_every_kind_of_bad_row_in_one_jsonl_gives_exact_counts(tmp_path: Path) -> None:
    source = write_jsonl(tmp_path / "mixed.jsonl", [line for line, _ in BAD_AND_GOOD_LINES])
    out_dir = tmp_path / "prepared"
    report = prepare_preference_data([source], out_dir, SETTINGS, word_lengths)

    assert drop_counts(report) == EXPECTED_COUNTS
    assert report.rows_read == len(BAD_AND_GOOD_LINES)
    assert report.pairs_kept == 8
    assert set(report.drops) == {
        "malformed_json",
        "missing_field",
        "wrong_type",
        "empty_reply",
        "identical_replies",
        "prompt_mismatch",
        "malformed_turns",
        "too_long",
        "duplicate_pair",
    }
    expected_lines: dict[str, list[int]] = {}
    for line_number, (_, reason) in enumerate(BAD_AND_GOOD_LINES, start=1):
        if reason is not None:
            expected_lines.setdefault(reason, []).append(line_number)
    for reason, lines in expected_lines.items():
        assert [example.line for example in report.drops[reason].examples] == lines
        assert all(example.source == "mixed.jsonl" and example.detail for example in report.drops[reason].examples)
    assert report.formats == {"hh_transcript": 15, "prompt_chosen_rejected": 4}
    assert set(path.name for path in out_dir.iterdir()) == OUTPUT_FILES
    assert load_report(out_dir) == report


def test_json_list_variant_gives_exact_counts(tmp_path: Path) -> None:
    rows = [json.loads(line) for line, reason in BAD_AND_GOOD_LINES if not line.startswith("{not")]
    (tmp_path / "mixed.json").write_text(json.dumps({"data": rows}))
    report = prepare_preference_data([tmp_path / "mixed.json"], tmp_path / "out", SETTINGS, word_lengths)
    assert drop_counts(report) == {**EXPECTED_COUNTS, "malformed_json": 1}  # the list element [1, 2, 3]
    assert report.pairs_kept == 8


def test_parquet_variant_gives_exact_counts(tmp_path: Path) -> None:
    def shared_prompt(reply: str) -> str:
        return hh(("Human", "q"), ("Assistant", reply))

    rows = [
        good_hh(1),
        good_hh(2),
        good_hh(3),
        good_hh(4),
        {"chosen": shared_prompt("a"), "rejected": None},  # missing_field
        {"chosen": shared_prompt(""), "rejected": shared_prompt("b")},  # empty_reply
        {"chosen": shared_prompt("x"), "rejected": shared_prompt("x")},  # identical_replies
        {"chosen": shared_prompt("a"), "rejected": hh(("Human", "r"), ("Assistant", "b"))},  # prompt_mismatch
        {"chosen": hh(("Assistant", "a")), "rejected": hh(("Assistant", "b"))},  # malformed_turns
        good_hh(2),  # duplicate_pair
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "pairs.parquet")
    report = prepare_preference_data([tmp_path / "pairs.parquet"], tmp_path / "out", SETTINGS, word_lengths)
    assert drop_counts(report) == {
        "missing_field": 1,
        "empty_reply": 1,
        "identical_replies": 1,
        "prompt_mismatch": 1,
        "malformed_turns": 1,
        "duplicate_pair": 1,
    }
    assert report.drops["duplicate_pair"].examples[0].line == 10


def test_outputs_round_trip_and_report_matches_them(tmp_path: Path) -> None:
    lines = [json.dumps(good_hh(number)) for number in range(60)] + [json.dumps(good_pcr(n)) for n in range(60)]
    source = write_jsonl(tmp_path / "good.jsonl", lines)
    out_dir = tmp_path / "prepared"
    report = prepare_preference_data([source], out_dir, SETTINGS, word_lengths)

    pairs = {name: load_split(out_dir, name) for name in ("rm_train", "rm_val", "eval")}
    sft, ppo = load_split(out_dir, "sft"), load_split(out_dir, "ppo_prompts")
    ppo_val, ppo_pairs = load_split(out_dir, "ppo_val_prompts"), load_split(out_dir, "ppo_pairs")
    assert report.split_counts == {
        **{name: len(items) for name, items in pairs.items()},
        "sft": len(sft),
        "ppo_prompts": len(ppo),
        "ppo_val_prompts": len(ppo_val),
        "ppo_pairs": len(ppo_pairs),
    }
    # one pair per prompt: the PPO bucket's pairs are its training and validation prompts
    assert {pair.prompt_id for pair in ppo_pairs} == {prompt.prompt_id for prompt in ppo + ppo_val}
    assert len(ppo_pairs) == len(ppo) + len(ppo_val)
    assert sum(len(items) for items in pairs.values()) + len(ppo_pairs) == 120
    assert all(len(items) > 0 for items in (*pairs.values(), sft, ppo))
    first = pairs["rm_train"][0]
    assert isinstance(first, PreferencePair) and first.source == "good.jsonl"
    assert first.line >= 1 and isinstance(first.prompt[0]["content"], str)
    assert [pair.line for pair in pairs["rm_train"]] == sorted(pair.line for pair in pairs["rm_train"])

    table = pq.read_table(out_dir / "rm_train.parquet")
    assert table.column_names == ["pair_id", "prompt_id", "prompt", "chosen", "rejected", "source", "line"]
    assert table.column("prompt_id").to_pylist() == [pair.prompt_id for pair in pairs["rm_train"]]
    assert pq.read_table(out_dir / "sft.parquet").column_names == ["prompt_id", "prompt", "response"]
    assert pq.read_table(out_dir / "ppo_prompts.parquet").column_names == ["prompt_id", "prompt"]

    assert report.sources[0].rows == 120 and report.settings == SETTINGS


def test_token_length_statistics_match_a_reference(tmp_path: Path) -> None:
    rows = [{"prompt": "w " * (n + 1), "chosen": "c " * (2 * n + 1), "rejected": "r " * (n % 7 + 1)} for n in range(15)]
    source = write_jsonl(tmp_path / "lengths.jsonl", [json.dumps(row) for row in rows])
    report = prepare_preference_data([source], tmp_path / "out", SETTINGS, word_lengths)

    def total_words(row: dict) -> int:
        return row["prompt"].count("w") + max(row["chosen"].count("c"), row["rejected"].count("r"))

    kept = [row for row in rows if total_words(row) <= SETTINGS.max_total_tokens]
    assert report.pairs_kept == len(kept) and report.drops["too_long"].count == len(rows) - len(kept)
    for field, letter in (("prompt", "w"), ("chosen", "c"), ("rejected", "r")):
        values = sorted(row[field].count(letter) for row in kept)
        stats = report.token_lengths[field]
        position = 0.95 * (len(values) - 1)  # linear interpolation between closest ranks
        low = int(position)
        p95 = values[low] + (values[min(low + 1, len(values) - 1)] - values[low]) * (position - low)
        assert (stats.min, stats.max) == (values[0], values[-1])
        assert stats.mean == pytest.approx(sum(values) / len(values))
        assert stats.p95 == pytest.approx(p95)


def test_content_hash_and_multiple_sources(tmp_path: Path) -> None:
    first = write_jsonl(tmp_path / "a.jsonl", [json.dumps(good_hh(n)) for n in range(10)])
    second = tmp_path / "b.jsonl.gz"
    second.write_bytes(gzip.compress(("\n".join(json.dumps(good_pcr(n)) for n in range(10)) + "\n").encode()))
    report = prepare_preference_data([first, second], tmp_path / "out", SETTINGS, word_lengths)
    assert [(s.name, s.rows, s.formats) for s in report.sources] == [
        ("a.jsonl", 10, {"hh_transcript": 10}),
        ("b.jsonl.gz", 10, {"prompt_chosen_rejected": 10}),
    ]
    assert report.sources[1].sha256 == hashlib.sha256(second.read_bytes()).hexdigest()
    again = prepare_preference_data([first, second], tmp_path / "out2", SETTINGS, word_lengths)
    assert again.input_sha256 == report.input_sha256
    for name in OUTPUT_FILES - {DATA_REPORT_FILE}:
        assert (tmp_path / "out" / name).read_bytes() == (tmp_path / "out2" / name).read_bytes()


def test_truncated_gz_fails_clearly_and_leaves_no_output(tmp_path: Path) -> None:
    source = tmp_path / "input" / "cut.jsonl.gz"
    source.parent.mkdir()
    text = "\n".join(json.dumps(good_hh(n)) for n in range(300)) + "\n"
    data = gzip.compress(text.encode(), mtime=0)
    source.write_bytes(data[: len(data) * 2 // 3])
    out_dir = tmp_path / "out" / "prepared"
    with pytest.raises(DataSourceError, match=r"cut\.jsonl\.gz is truncated or corrupt.*line \d+"):
        prepare_preference_data([source], out_dir, SETTINGS, word_lengths)
    assert not out_dir.exists()
    assert no_report_anywhere(tmp_path)
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())


def test_empty_file_fails_clearly_and_leaves_no_output(tmp_path: Path) -> None:
    source = tmp_path / "empty.jsonl"
    source.write_bytes(b"")
    with pytest.raises(DataSourceError, match=r"empty\.jsonl is empty"):
        prepare_preference_data([source], tmp_path / "prepared", SETTINGS, word_lengths)
    assert not (tmp_path / "prepared").exists()
    assert no_report_anywhere(tmp_path)


def test_failed_validation_leaves_previous_good_output_untouched(tmp_path: Path) -> None:
    good = write_jsonl(tmp_path / "good.jsonl", [json.dumps(good_hh(n)) for n in range(40)])
    out_dir = tmp_path / "prepared"
    prepare_preference_data([good], out_dir, SETTINGS, word_lengths)
    before = {path.name: path.read_bytes() for path in out_dir.iterdir()}

    mostly_bad = write_jsonl(tmp_path / "bad.jsonl", [json.dumps(good_hh(1))] + ["{broken"] * 5)
    strict = SETTINGS.model_copy(update={"max_drop_fraction": 0.5})
    with pytest.raises(DataValidationError, match=r"bad\.jsonl.*kept 1/6.*malformed_json=5"):
        prepare_preference_data([mostly_bad], out_dir, strict, word_lengths)
    assert {path.name: path.read_bytes() for path in out_dir.iterdir()} == before
    beside = ["bad.jsonl", "good.jsonl", "prepared", "prepared.failed_report.json"]  # the refusal's report only
    assert sorted(path.name for path in tmp_path.iterdir()) == beside


def test_successful_rerun_replaces_old_output_completely(tmp_path: Path) -> None:
    out_dir = tmp_path / "prepared"
    first = write_jsonl(tmp_path / "first.jsonl", [json.dumps(good_hh(n)) for n in range(40)])
    prepare_preference_data([first], out_dir, SETTINGS, word_lengths)
    (out_dir / "stale.txt").write_text("from an older run")
    second = write_jsonl(tmp_path / "second.jsonl", [json.dumps(good_pcr(n)) for n in range(25)])
    report = prepare_preference_data([second], out_dir, SETTINGS, word_lengths)
    assert {path.name for path in out_dir.iterdir()} == OUTPUT_FILES
    assert load_report(out_dir).sources[0].name == "second.jsonl" == report.sources[0].name
    assert sorted(path.name for path in tmp_path.iterdir()) == ["first.jsonl", "prepared", "second.jsonl"]


def test_failure_while_writing_removes_the_temp_dir_and_keeps_the_old_output(tmp_path: Path) -> None:
    out_dir = tmp_path / "prepared"
    out_dir.mkdir()
    (out_dir / DATA_REPORT_FILE).write_text("{}")
    with pytest.raises(RuntimeError, match="disk full"):
        with atomic_directory(out_dir) as temp_dir:
            (temp_dir / "rm_train.parquet").write_bytes(b"partial")
            raise RuntimeError("disk full")
    assert [path.name for path in tmp_path.iterdir()] == ["prepared"]
    assert [path.name for path in out_dir.iterdir()] == [DATA_REPORT_FILE]


def test_load_split_refuses_an_incomplete_directory(tmp_path: Path) -> None:
    (tmp_path / "rm_train.parquet").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=DATA_REPORT_FILE):
        load_split(tmp_path, "rm_train")


def test_a_refused_input_leaves_its_report_beside_the_untouched_previous_output(tmp_path: Path) -> None:
    out_dir = tmp_path / "prepared"
    good = write_jsonl(tmp_path / "good.jsonl", [json.dumps(good_hh(n)) for n in range(40)])
    prepare_preference_data([good], out_dir, SETTINGS, word_lengths)
    before = {path.name: path.read_bytes() for path in out_dir.iterdir()}
    bad = write_jsonl(tmp_path / "bad.jsonl", [json.dumps({"prompt": 5, "chosen": "a", "rejected": "b"})] * 3)

    with pytest.raises(DataValidationError) as raised:
        prepare_preference_data([bad], out_dir, SETTINGS, word_lengths)
    failed = failed_report_path(out_dir)
    assert failed == tmp_path / "prepared.failed_report.json"
    assert str(raised.value).endswith(f"every drop is in {failed}")
    assert "wrong_type: bad.jsonl line 1 (field 'prompt' is a number, expected a string or a list of messages)" in str(
        raised.value
    )
    report = FailedDataReport.model_validate_json(failed.read_text())
    assert report.error in str(raised.value) and report.rows_read == 3 and report.pairs_kept == 0
    assert [example.line for example in report.drops["wrong_type"].examples] == [1, 2, 3]
    assert {path.name: path.read_bytes() for path in out_dir.iterdir()} == before

    prepare_preference_data([good], out_dir, SETTINGS, word_lengths)
    assert not failed.exists()  # the refusal no longer describes the output
