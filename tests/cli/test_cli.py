"""The `rlhf` command as a user runs it: exit status, one-line errors, outputs where promised."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from fixtures.commands import RLHF_COMMAND
from fixtures.paths import PARAMS, ROOT, SHARED_PAIRS, TINY
from fixtures.tiny_ppo import hh_pair


def rlhf(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    """Run the installed console entry point in a fresh process."""
    command = [*RLHF_COMMAND, *args]
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_config_show_prints_resolved_yaml() -> None:
    result = rlhf("config", "show", "-c", str(TINY), "-s", "ppo.preset=vanilla")
    assert result.returncode == 0, result.stderr
    assert "kind: tiny" in result.stdout
    assert "value_clip: null" in result.stdout  # the vanilla preset filled the switch


@pytest.mark.slow
def test_bad_config_is_one_line_on_stderr_with_status_2() -> None:
    result = rlhf("config", "show", "-s", "sft.lr=-1")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rlhf: error: invalid configuration: sft.lr")


@pytest.mark.slow
def test_prepare_data_writes_splits_report_and_metrics(tmp_path: Path) -> None:
    data = tmp_path / "pairs.jsonl"
    rows = [json.dumps(hh_pair(i)) for i in range(40)] + ["{broken"]
    data.write_text("\n".join(rows) + "\n")
    out = tmp_path / "prepared"
    result = rlhf("prepare-data", "-c", str(TINY), "--data", str(data), "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert "kept 40 of 41 rows (dropped: malformed_json 1)" in result.stdout
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["pairs_kept"] == 40 and metrics["dropped.malformed_json"] == 1
    assert metrics["split.rm_train"] > 0 and metrics["split.sft"] == metrics["split.rm_train"]
    assert {p.name for p in out.iterdir()} >= {"data_report.json", "metrics.json", "sft.parquet"}


@pytest.mark.slow
def test_prepare_data_accepts_a_directory_of_files(tmp_path: Path) -> None:
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "a.jsonl").write_text("\n".join(json.dumps(hh_pair(i)) for i in range(10)) + "\n")
    (raw / "b.jsonl").write_text("\n".join(json.dumps(hh_pair(i)) for i in range(10, 25)) + "\n")
    result = rlhf("prepare-data", "-c", str(TINY), "--data", str(raw), "--out", str(tmp_path / "out"))
    assert result.returncode == 0, result.stderr
    report = json.loads((tmp_path / "out" / "data_report.json").read_text())
    assert [Path(source["name"]).name for source in report["sources"]] == ["a.jsonl", "b.jsonl"]
    assert report["pairs_kept"] == 25


@pytest.mark.slow
def test_missing_data_file_fails_cleanly(tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = rlhf("prepare-data", "-c", str(TINY), "--data", str(tmp_path / "nope.jsonl"), "--out", str(out))
    assert result.returncode == 1
    assert "nope.jsonl" in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not out.exists()


@pytest.mark.skipif(not SHARED_PAIRS.is_file(), reason="shared HH-RLHF pairs not present")
@pytest.mark.slow
def test_prepare_data_on_the_shared_hh_pairs(tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = rlhf("prepare-data", "--data", str(SHARED_PAIRS), "--out", str(out))
    assert result.returncode == 0, result.stderr
    report = json.loads((out / "data_report.json").read_text())
    assert report["rows_read"] == 1800
    assert report["drops"]["empty_reply"]["count"] == 4
    assert report["drops"]["malformed_turns"]["count"] == 5
    assert report["split_counts"]["rm_val"] >= 300  # RM accuracy is reported on >= 300 pairs


@pytest.mark.slow
def test_refused_data_names_the_offending_rows_and_leaves_the_report_beside_the_output(tmp_path: Path) -> None:
    data = tmp_path / "bad.jsonl"
    rows = [json.dumps(hh_pair(0)), json.dumps({"chosen": 3, "rejected": "x"}), json.dumps({"question": "hi"})]
    rows += [json.dumps({"prompt": "p", "chosen": "same", "rejected": "same"}) for _ in range(8)]
    data.write_text("\n".join(rows) + "\n")
    out = tmp_path / "prepared"
    result = rlhf("prepare-data", "-c", str(TINY), "--data", str(data), "--out", str(out))
    assert result.returncode == 1
    (line,) = result.stderr.strip().splitlines()
    assert "90.9% of rows were dropped, more than max_drop_fraction=90.0%" in line
    assert (
        "first dropped rows: identical_replies: bad.jsonl line 4 (chosen and rejected replies are identical), "
        "bad.jsonl line 5 (chosen and rejected replies are identical), bad.jsonl line 6 (chosen and rejected "
        "replies are identical); missing_field: bad.jsonl line 3 (row has none of the fields "
        "prompt/chosen/rejected (keys: ['question'])); wrong_type: bad.jsonl line 2 (field 'chosen' is a number, "
        "expected a string)"
    ) in line
    failed = tmp_path / "prepared.failed_report.json"
    assert line.endswith(f"every drop is in {failed}")
    report = json.loads(failed.read_text())
    assert report["rows_read"] == 11 and report["pairs_kept"] == 1
    assert [example["line"] for example in report["drops"]["identical_replies"]["examples"]] == [4, 5, 6, 7, 8]
    assert not out.exists()


@pytest.mark.parametrize("where", ["raw/pairs", "./pairs", "a/b/pairs"])
@pytest.mark.slow
def test_a_missing_local_path_is_named_and_not_looked_up_on_the_hub(tmp_path: Path, where: str) -> None:
    (tmp_path / "raw").mkdir()
    out = tmp_path / "out"
    params = str(PARAMS)
    result = rlhf("prepare-data", "--params", params, "-c", str(TINY), "--data", where, "--out", str(out), cwd=tmp_path)
    assert result.returncode == 1
    assert f"input not found: {where.removeprefix('./')} (a local path, so it was not looked up" in result.stderr
    assert "Hub could not be reached" not in result.stderr
