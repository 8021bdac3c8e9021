"""rlhf_core.data.versioning: checking a new preference file against the raw data, and merging it in.

No DVC and no tokenizer here: token lengths are whitespace word counts, and the evaluation split is
checked against a plain re-implementation of the prompt hash (normalise, sha256, salted bucket).
"""

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from fixtures.pairs import word_lengths
from rlhf_core.config import DataConfig
from rlhf_core.data.prepare import split_config
from rlhf_core.data.records import DropReason, PreferencePair
from rlhf_core.data.validation import DataValidationError, DropLog
from rlhf_core.data.versioning import (
    OVERLAP_ROWS_SHOWN,
    NewFileReport,
    check_new_file,
    eval_prompt_ids,
    find_eval_overlap,
    merge_into_raw,
    preference_files,
    read_raw_pairs,
)

SETTINGS = DataConfig(max_total_tokens=40, max_drop_fraction=0.5, eval_fraction=0.1, split_salt="test-salt")


def reference_is_eval(prompt: str, salt: str = SETTINGS.split_salt, fraction: float = SETTINGS.eval_fraction) -> bool:
    """The split rule written out: one user message, whitespace collapsed, case-folded, salted sha256."""
    prompt_id = hashlib.sha256(("user: " + " ".join(prompt.split()).casefold()).encode()).hexdigest()
    bucket = int.from_bytes(hashlib.sha256(f"{salt}\n{prompt_id}".encode()).digest()[:8], "big") / 2**64
    return bucket < fraction


def row(prompt: str, chosen: str = "A helpful and careful answer.", rejected: str = "No.") -> dict[str, str]:
    return {"prompt": prompt, "chosen": chosen, "rejected": rejected}


def write_jsonl(path: Path, rows: list[dict[str, object] | str]) -> Path:
    lines = [item if isinstance(item, str) else json.dumps(item) for item in rows]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


PROMPTS = [f"How do I fix problem number {index}?" for index in range(60)]
EVAL_PROMPTS = [prompt for prompt in PROMPTS if reference_is_eval(prompt)]
OTHER_PROMPTS = [prompt for prompt in PROMPTS if not reference_is_eval(prompt)]


@pytest.fixture
def raw_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "raw"
    directory.mkdir()
    write_jsonl(directory / "first.jsonl", [row(prompt) for prompt in PROMPTS])
    return directory


def test_the_generated_prompts_cover_both_sides_of_the_split() -> None:
    assert len(EVAL_PROMPTS) >= 2 and len(OTHER_PROMPTS) >= 2  # what the tests below use


def test_new_rows_whose_prompt_is_an_evaluation_prompt_are_reported(raw_dir: Path, tmp_path: Path) -> None:
    respaced = "  " + EVAL_PROMPTS[1].upper().replace(" ", "   ") + " "  # the same prompt once normalised
    new = write_jsonl(
        tmp_path / "new.jsonl",
        [
            row("A brand new question about gardening?"),
            row(EVAL_PROMPTS[0], chosen="Another careful answer."),
            row(OTHER_PROMPTS[0], chosen="Another careful answer."),
            row(respaced, chosen="Yet another careful answer."),
            row("A second brand new question about cooking?"),
        ],
    )
    report = check_new_file(new, raw_dir, SETTINGS, word_lengths)

    assert [pair.line for pair in report.eval_overlap] == [2, 4]
    assert (report.rows, len(report.pairs), report.drops.total) == (5, 5, 0)
    new_prompts = [
        "A brand new question about gardening?",
        EVAL_PROMPTS[0],
        OTHER_PROMPTS[0],
        respaced,
        "A second brand new question about cooking?",
    ]
    assert report.pairs_by_split.get("eval", 0) == sum(reference_is_eval(prompt) for prompt in new_prompts)
    assert sum(report.pairs_by_split.values()) == 5
    summary = report.summary()
    assert "2 new row(s) have a prompt that is already an evaluation prompt" in summary
    assert f"line 2: prompt {report.eval_overlap[0].prompt_id[:12]} {EVAL_PROMPTS[0]!r}" in summary


def test_a_file_without_evaluation_prompts_says_so(raw_dir: Path, tmp_path: Path) -> None:
    new = write_jsonl(tmp_path / "new.jsonl", [row(OTHER_PROMPTS[1], chosen="A different answer.")])
    report = check_new_file(new, raw_dir, SETTINGS, word_lengths)
    assert report.eval_overlap == []
    assert "no new row has a prompt that is already an evaluation prompt" in report.summary()


def test_a_row_already_in_the_raw_data_is_a_duplicate(raw_dir: Path, tmp_path: Path) -> None:
    new = write_jsonl(tmp_path / "new.jsonl", [row(PROMPTS[5]), row(PROMPTS[5], chosen="A new answer."), row("New?")])
    report = check_new_file(new, raw_dir, SETTINGS, word_lengths)

    assert [pair.line for pair in report.pairs] == [2, 3]
    assert report.drops.counts == {DropReason.DUPLICATE_PAIR: 1}
    (duplicate,) = report.drops.examples[DropReason.DUPLICATE_PAIR]
    assert (duplicate.line, duplicate.detail) == (1, "same prompt, chosen and rejected as first.jsonl line 6")


def test_the_same_file_under_a_new_name_is_refused_as_all_duplicates(raw_dir: Path, tmp_path: Path) -> None:
    copy = shutil.copyfile(raw_dir / "first.jsonl", tmp_path / "again.jsonl")
    with pytest.raises(
        DataValidationError,
        match=r"no valid preference pairs remain; kept 0/60 rows; "
        r"drops by reason: duplicate_pair=60",
    ):
        check_new_file(Path(copy), raw_dir, SETTINGS, word_lengths)


def test_drops_within_max_drop_fraction_are_accepted_and_counted(raw_dir: Path, tmp_path: Path) -> None:
    long_reply = " ".join(["word"] * 50)  # 50 words > max_total_tokens=40
    new = write_jsonl(
        tmp_path / "new.jsonl", [row("Q1?"), row("Q2?", chosen=long_reply), row("Q3?", "Same", "Same"), row("Q4?")]
    )
    report = check_new_file(new, raw_dir, SETTINGS, word_lengths)
    assert [pair.line for pair in report.pairs] == [1, 4]
    assert report.drops.counts == {DropReason.TOO_LONG: 1, DropReason.IDENTICAL_REPLIES: 1}
    assert "dropped: identical_replies 1, too_long 1" in report.summary()


def test_a_file_preparation_would_refuse_is_refused_with_its_message(raw_dir: Path, tmp_path: Path) -> None:
    new = write_jsonl(
        tmp_path / "bad.jsonl",
        [row("Q1?"), row("Q2?"), row("Q3?", "Same", "Same"), {"question": "no fields"}, "{not json"],
    )
    with pytest.raises(DataValidationError) as raised:
        check_new_file(new, raw_dir, SETTINGS, word_lengths)
    assert str(raised.value) == (
        f"data validation failed for {new}: 60.0% of rows were dropped, more than max_drop_fraction=50.0%; "
        "kept 2/5 rows; drops by reason: identical_replies=1, malformed_json=1, missing_field=1; first dropped rows: "
        "identical_replies: bad.jsonl line 3 (chosen and rejected replies are identical); malformed_json: bad.jsonl "
        "line 5 (not valid JSON: Expecting property name enclosed in double quotes: line 1 column 2 (char 1)); "
        "missing_field: bad.jsonl line 4 (row has none of the fields prompt/chosen/rejected (keys: ['question']))"
    )


def test_a_name_already_in_the_raw_data_is_refused(raw_dir: Path, tmp_path: Path) -> None:
    new_dir = tmp_path / "incoming"
    new_dir.mkdir()
    new = write_jsonl(new_dir / "first.jsonl", [row("Something new?")])
    with pytest.raises(FileExistsError, match="first.jsonl already exists"):
        check_new_file(new, raw_dir, SETTINGS, word_lengths)
    with pytest.raises(FileExistsError, match="first.jsonl already exists"):
        merge_into_raw(new, raw_dir)
    assert (raw_dir / "first.jsonl").read_text().count("\n") == len(PROMPTS)


def test_eval_prompt_ids_follow_the_prompt_hash_split() -> None:
    pairs = [
        PreferencePair(({"role": "user", "content": prompt},), "a", "b", "f", line)
        for line, prompt in enumerate(PROMPTS, start=1)
    ]
    expected = {pair.prompt_id for pair, prompt in zip(pairs, PROMPTS, strict=True) if reference_is_eval(prompt)}
    assert eval_prompt_ids(pairs, split_config(SETTINGS)) == expected
    assert find_eval_overlap(pairs, expected) == [pair for pair in pairs if pair.prompt_id in expected]


def test_read_raw_pairs_reads_every_preference_file_and_skips_bad_rows(raw_dir: Path) -> None:
    write_jsonl(raw_dir / "second.jsonl", [row("Z?"), "{broken", row("Y?", "Same", "Same")])
    (raw_dir / "notes.txt").write_text("not a preference file")

    assert [path.name for path in preference_files(raw_dir)] == ["first.jsonl", "second.jsonl"]
    pairs = read_raw_pairs(raw_dir)
    assert len(pairs) == len(PROMPTS) + 1
    assert (pairs[-1].source, pairs[-1].line, pairs[-1].prompt[0]["content"]) == ("second.jsonl", 1, "Z?")
    assert read_raw_pairs(raw_dir / "missing") == []


def test_merge_copies_the_bytes_under_the_same_name(tmp_path: Path) -> None:
    source = tmp_path / "new.jsonl.gz"
    source.write_bytes(bytes(range(256)) * 10)
    merged = merge_into_raw(source, tmp_path / "raw")  # the directory is created on first use
    assert merged == tmp_path / "raw" / "new.jsonl.gz"
    assert merged.read_bytes() == source.read_bytes()
    assert sorted(path.name for path in (tmp_path / "raw").iterdir()) == ["new.jsonl.gz"]


def test_an_interrupted_merge_leaves_nothing_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = write_jsonl(tmp_path / "new.jsonl", [row("Q?")])
    raw = tmp_path / "raw"

    def copy_half_then_fail(src: str, dst: str) -> None:
        Path(dst).write_bytes(Path(src).read_bytes()[:5])
        raise OSError("disk full")

    monkeypatch.setattr(shutil, "copyfile", copy_half_then_fail)
    with pytest.raises(OSError, match="disk full"):
        merge_into_raw(source, raw)
    assert list(raw.iterdir()) == []


def test_the_summary_lists_the_first_overlapping_rows_and_counts_the_rest() -> None:
    overlap = [
        PreferencePair(({"role": "user", "content": f"Question {line}?"},), "a", "b", "new.jsonl", line)
        for line in range(1, OVERLAP_ROWS_SHOWN + 6)
    ]
    report = NewFileReport(
        name="new.jsonl",
        rows=len(overlap),
        pairs=overlap,
        drops=DropLog(),
        eval_overlap=overlap,
        pairs_by_split={"eval": len(overlap)},
    )
    lines = report.summary().splitlines()
    assert lines[0] == f"new.jsonl: {len(overlap)} of {len(overlap)} rows are new valid pairs (dropped: none)"
    assert lines[1] == f"new pairs by split: eval {len(overlap)}, rm_val 0, ppo 0, rm_train 0"
    listed = [line for line in lines if line.startswith("  line ")]
    assert len(listed) == OVERLAP_ROWS_SHOWN
    assert lines[-1] == "  ... and 5 more"
