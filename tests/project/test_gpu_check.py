"""scripts/gpu_check.sh: its CPU dry run (what CI runs) passes and prints the figures of the benchmark it
ran (PPO throughput, generation against its bound, the rollout engines side by side), and its argument and
data checks fail with a message naming the problem.

The dry run is the real script end to end: the tiny pipeline through `rlhf run` (temporary Prefect
server, SQLite MLflow store), then benchmarks/ppo_throughput.py on the tiny model. Its printed summary is
compared with the benchmark's JSON report, which the script names in its work directory.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from fixtures.paths import ROOT, SHARED_PAIRS

SCRIPT = ROOT / "scripts" / "gpu_check.sh"
PEAK_TFLOPS = 0.5  # a made-up CPU "peak", so that the dry run computes and prints MFU too
DRY_RUN_TIMEOUT_S = 1500


def summary_figures(stdout: str) -> dict[str, str]:
    """`name   value` lines after the script's `== summary` header, by name."""
    summary = stdout.split("== summary", 1)[1]
    figures = {}
    for line in summary.splitlines()[1:]:
        match = re.match(r"(\S+(?: \S+)*?)\s{2,}(.+)", line)
        if match:
            figures[match[1]] = match[2]
    return figures


def number(text: str) -> float:
    return float(re.match(r"[\d.,]+", text)[0].replace(",", ""))


@pytest.mark.slow
@pytest.mark.timeout(DRY_RUN_TIMEOUT_S)
@pytest.mark.skipif(not SHARED_PAIRS.is_file(), reason="shared HH-RLHF pairs not present")
def test_dry_run_passes_and_prints_the_benchmark_figures(tmp_path: Path) -> None:
    result = subprocess.run(
        [str(SCRIPT), "--dry-run", "--work-dir", str(tmp_path), "--peak-tflops", str(PEAK_TFLOPS)],
        capture_output=True,
        text=True,
        timeout=DRY_RUN_TIMEOUT_S,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert result.stdout.rstrip().endswith("gpu_check: PASSED")
    figures = summary_figures(result.stdout)
    report = json.loads((tmp_path / "ppo_throughput.json").read_text())
    settings = report["settings"]

    # The benchmark ran what a dry run asks for: the tiny model, on the CPU, two measured iterations.
    assert (settings["model"], settings["device"], report["iterations"]) == ("tiny", "cpu", 2)
    assert figures["device"] == "cpu"

    # Every printed figure is the report's, and they agree with each other.
    samples_per_s, tokens_per_s = number(figures["samples/s"]), number(figures["tokens/s"])
    assert samples_per_s > 0 and samples_per_s == pytest.approx(report["samples_per_s"], abs=1e-3)
    assert tokens_per_s == pytest.approx(samples_per_s * settings["response_length"], rel=1e-2, abs=0.1)
    split = dict(re.findall(r"(generate|score|train|other) ([\d.]+) %", figures["time split"]))
    assert set(split) == {"generate", "score", "train", "other"}
    assert sum(float(share) for share in split.values()) == pytest.approx(100, abs=0.3)
    peak_mib = number(figures["peak memory"])
    assert peak_mib > 0 and peak_mib == pytest.approx(report["peak_memory_bytes"] / 2**20, abs=0.1)
    model_tflops = report["flops"]["model_tflops_per_s"]
    assert number(figures["MFU"]) == pytest.approx(100 * model_tflops / PEAK_TFLOPS, abs=0.01)
    assert f"of {PEAK_TFLOPS:g} TFLOP/s" in figures["MFU"]

    # Generation against its bound, the batch sweep, and the engines side by side (the lean engine drawing
    # as generate does draws hf's tokens: both float32 on the CPU).
    generation = report["generation"]
    assert generation["engine"] == "lean" and [row["batch_size"] for row in generation["sweep"]] == [2, 4]
    assert "rollout engines" in figures and figures["generation"].startswith("engine lean")
    engines = json.loads((tmp_path / "rollout_engines.json").read_text())["batches"]["4"]
    assert engines["lean-multinomial"]["same_tokens_as_hf"] is True
    assert engines["lean"]["logprob_gap_max"] < 1e-4 and engines["lean-multinomial"]["logprob_gap_max"] < 1e-4

    # The tiny pipeline ran every stage and registered the policy.
    run_dir = Path(re.search(r"run directory: (\S+)\)", figures["tiny pipeline"])[1])
    assert run_dir.parent == tmp_path / "runs"
    for stage in ("data", "sft", "reward", "ppo"):
        assert (run_dir / stage / "metrics.json").is_file(), stage
    assert re.search(r"^registered: rlhf-policy version \d+", (tmp_path / "pipeline.log").read_text(), re.MULTILINE)


@pytest.mark.slow
def test_unknown_option_is_refused_by_name() -> None:
    result = subprocess.run([str(SCRIPT), "--gpu"], capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 2
    assert "unknown option --gpu" in result.stderr


@pytest.mark.slow
def test_missing_data_fails_before_any_work(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-pairs.jsonl"
    result = subprocess.run(
        [str(SCRIPT), "--dry-run", "--data", str(missing), "--work-dir", str(tmp_path / "work")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 1
    assert f"no preference data at {missing}" in result.stderr
    assert not (tmp_path / "work").exists()
