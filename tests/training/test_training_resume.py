"""Exact resume: a training subprocess is SIGKILLed mid-run (and mid-checkpoint-write), then rerun.

The rerun must restart at the newest complete checkpoint's step + 1, leave a history with every step
exactly once, and end with the same weights, best metric and extra state as an uninterrupted run.
"""

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fixtures.paths import ROOT
from rlhf_core.training.checkpoint import MARKER_FILE, TEMPORARY_PREFIX, checkpoint_step, latest_checkpoint

SCRIPT = ROOT / "tests" / "scripts" / "train_tiny.py"
TOTAL_STEPS = 20
STEP_SLEEP = 0.03


def launch(workdir: Path, **env_extra: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRAIN_TINY_STEP_SLEEP": str(STEP_SLEEP), **env_extra}
    return subprocess.Popen(
        [sys.executable, str(SCRIPT), "--workdir", str(workdir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def run_to_completion(workdir: Path) -> dict:
    process = launch(workdir)
    stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == 0, stderr
    result_lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    return json.loads(result_lines[0].removeprefix("RESULT "))


def kill_after_line(process: subprocess.Popen[str], expected: str, delay: float) -> None:
    """Read stdout until `expected`, wait `delay` seconds, then SIGKILL the process mid-run."""
    assert process.stdout is not None
    for line in process.stdout:
        if line.strip() == expected:
            break
    else:
        stderr = process.stderr.read() if process.stderr else ""
        pytest.fail(f"the run ended without printing {expected!r}: {stderr}")
    time.sleep(delay)
    assert process.poll() is None, "the run finished before it could be killed; raise STEP_SLEEP"
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=30)
    assert process.returncode == -signal.SIGKILL


def executed_steps(workdir: Path) -> list[int]:
    return [int(line) for line in (workdir / "executed.txt").read_text().split()]


def history_steps(workdir: Path) -> list[int]:
    lines = (workdir / "history.jsonl").read_text().splitlines()
    return [json.loads(line)["step"] for line in lines]


def assert_same_weights(workdir: Path, reference: Path) -> None:
    final = load_file(str(workdir / "final.safetensors"))
    expected = load_file(str(reference / "final.safetensors"))
    assert final.keys() == expected.keys()
    for name in expected:
        assert torch.allclose(final[name], expected[name], rtol=0, atol=1e-6), name


def rerun_and_check(workdir: Path, reference_dir: Path, reference: dict) -> None:
    """Rerun to completion from the newest complete checkpoint and compare with the uninterrupted run."""
    latest = latest_checkpoint(workdir / "checkpoints")
    resumed_step = checkpoint_step(latest) if latest is not None else 0
    ran_before = len(executed_steps(workdir))
    result = run_to_completion(workdir)
    assert result["resumed_from"] == resumed_step
    assert executed_steps(workdir)[ran_before] == resumed_step + 1
    assert history_steps(workdir) == list(range(1, TOTAL_STEPS + 1))
    assert result["final_step"] == TOTAL_STEPS
    assert result["best_metric"] == pytest.approx(reference["best_metric"], abs=1e-6)
    assert result["running"] == pytest.approx(reference["running"], abs=1e-6)
    assert result["metrics"] == pytest.approx(reference["metrics"], abs=1e-6)
    assert_same_weights(workdir, reference_dir)
    assert not [p for p in (workdir / "checkpoints").iterdir() if p.name.startswith(TEMPORARY_PREFIX)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    workdir = tmp_path_factory.mktemp("uninterrupted")
    result = run_to_completion(workdir)
    assert result["resumed_from"] == 0
    assert executed_steps(workdir) == list(range(1, TOTAL_STEPS + 1))
    return workdir, result


@pytest.mark.slow
def test_rerun_after_a_random_kill_and_a_kill_during_a_checkpoint_write_matches_uninterrupted_run(
    reference: tuple[Path, dict], tmp_path: Path
) -> None:
    reference_dir, reference_result = reference
    checkpoints = tmp_path / "checkpoints"
    rng = random.Random(0)
    # Run 1: killed at a seeded moment, somewhere after step 2..10 (mid-step or mid-checkpoint).
    first = launch(tmp_path)
    kill_after_line(first, f"STEP {rng.randint(2, 10)}", delay=rng.uniform(0.0, STEP_SLEEP))
    # Run 2: resumes, then is killed while writing the step-12 checkpoint, just before its marker.
    second = launch(tmp_path, TRAIN_TINY_HANG_AT_CHECKPOINT="12")
    kill_after_line(second, "HANGING 12", delay=0.0)
    partial = [p for p in checkpoints.iterdir() if p.name.startswith(TEMPORARY_PREFIX)]
    assert len(partial) == 1 and (partial[0] / "model.safetensors").exists()
    assert not (partial[0] / MARKER_FILE).exists()
    assert latest_checkpoint(checkpoints) == checkpoints / "step-00000008"
    # Run 3: ignores the partial checkpoint, resumes after step 8 and finishes.
    rerun_and_check(tmp_path, reference_dir, reference_result)
