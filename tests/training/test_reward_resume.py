"""`rlhf train-rm` SIGKILLed at a random moment and rerun ends exactly where an uninterrupted run ends.

The killed run is the real command in a subprocess; the uninterrupted reference and the rerun call the
stage in this process (one thread, like the subprocess), which saves two interpreter start-ups and lets
the rerun's logger show which step it ran first.

The run crosses an epoch boundary and uses the frozen-layer cache (top block trainable), periodic
validation with best-model selection and checkpoints every 2 steps, so the rerun must restore weights,
optimizer, RNG, best metric and best step, and rebuild the cache to the same bits.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from fixtures.commands import RLHF_COMMAND
from fixtures.paths import PARAMS, ROOT, TINY
from fixtures.tiny_ppo import write_prepared_data
from rlhf_core.config import Config, load_config
from rlhf_core.stages.reward import run_train_rm
from rlhf_core.training.checkpoint import TEMPORARY_PREFIX, checkpoint_step, latest_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS = 16
SETTINGS = (
    "reward.init_from=base",
    "reward.epochs=3",
    f"reward.max_steps={STEPS}",
    "reward.checkpoint_every=2",
    "reward.eval_every=4",
    "reward.eval_batches=100",
    "reward.trainable_top_layers=1",
)


def config() -> Config:
    return load_config(PARAMS, [TINY], list(SETTINGS))


def command(data_dir: Path, out: Path) -> list[str]:
    overrides = [arg for setting in SETTINGS for arg in ("-s", setting)]
    return [*RLHF_COMMAND, "train-rm", "-c", str(TINY), *overrides, "--data-dir", str(data_dir), "--out", str(out)]


class StepRecorder:
    """A caller's logger that remembers which steps this process ran."""

    def __init__(self) -> None:
        self.steps: list[int] = []

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.steps.append(step)

    def log_params(self, params: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


def history_steps(out: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (out / "history.jsonl").read_text().splitlines()]


def history_length(out: Path) -> int:
    path = out / "history.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def problem_rows(count: int) -> list[dict[str, str]]:
    """HH-style pairs about numbered problems."""
    rows = []
    for i in range(count):
        prompt = f"\n\nHuman: What should I do about problem {i}?"
        rows.append(
            {
                "chosen": f"{prompt}\n\nAssistant: Let us look at problem {i} calmly, step by step.",
                "rejected": f"{prompt}\n\nAssistant: Problem {i} is yours, not mine.",
            }
        )
    return rows


@pytest.fixture(scope="module")
def resume_data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Not the shared `data_dir` (36 reward-model training pairs): 120 pairs give 60, so the 16 steps of 8
    pairs cross an epoch boundary and end before `reward.epochs=3` would stop the run."""
    return write_prepared_data(tmp_path_factory.mktemp("resume-data"), problem_rows(120))


@pytest.fixture(scope="module")
def reference(resume_data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("uninterrupted") / "reward"
    run_train_rm(config(), resume_data_dir, None, out)
    return out


def kill_at_a_random_moment(data_dir: Path, out: Path, rng: random.Random) -> None:
    """Start the run, wait until a random number of steps is logged, wait a random instant, SIGKILL it."""
    target = rng.randint(3, STEPS - 4)
    process = subprocess.Popen(
        command(data_dir, out),
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    deadline = time.monotonic() + 240
    while history_length(out) < target:
        assert process.poll() is None, "the run ended before it could be killed"
        assert time.monotonic() < deadline, "the run made no progress"
        time.sleep(0.01)
    time.sleep(rng.uniform(0.0, 0.2))
    assert process.poll() is None, "the run finished before it could be killed"
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=30)


@pytest.mark.slow
def test_rerun_after_sigkill_matches_the_uninterrupted_run(
    resume_data_dir: Path, reference: Path, tmp_path: Path
) -> None:
    out = tmp_path / "reward"
    kill_at_a_random_moment(resume_data_dir, out, random.Random(7))
    assert not (out / "metrics.json").exists()
    latest = latest_checkpoint(out / "checkpoints")
    assert latest is not None
    resumed_step = checkpoint_step(latest)

    recorder = StepRecorder()
    metrics = run_train_rm(config(), resume_data_dir, None, out, logger=recorder).metrics
    expected = json.loads((reference / "metrics.json").read_text())
    assert recorder.steps == list(range(resumed_step + 1, STEPS + 1))  # first new step: checkpoint + 1
    assert metrics["resumed_from"] == resumed_step and expected["resumed_from"] == 0
    assert history_steps(out) == list(range(1, STEPS + 1))  # every step exactly once
    for name in ("best_step", "val/accuracy", "val/margin_mean", "val/loss", "train_loss"):
        assert metrics[name] == pytest.approx(expected[name], abs=1e-6), name
    for weights in (
        "model/model.safetensors",
        "model/head.safetensors",
        f"checkpoints/step-{STEPS:08d}/model.safetensors",
    ):
        ours, theirs = load_file(str(out / weights)), load_file(str(reference / weights))
        assert ours.keys() == theirs.keys()
        for name in theirs:
            assert torch.allclose(ours[name], theirs[name], rtol=0, atol=1e-6), f"{weights}: {name}"
    assert not [p for p in (out / "checkpoints").iterdir() if p.name.startswith(TEMPORARY_PREFIX)]
