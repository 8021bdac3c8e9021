"""`rlhf train-rm` and `rlhf score-pairs` as a user runs them, on a small generated pair file."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from fixtures.commands import RLHF_COMMAND
from fixtures.paths import PARAMS, ROOT, TINY
from rlhf_core.config import load_config
from rlhf_core.stages.prepare_data import run_prepare_data
from rlhf_core.stages.score_pairs import score_pair_file
from rlhf_core.stages.sft import run_sft

pytestmark = pytest.mark.usefixtures("one_thread")


def rlhf(*args: str) -> subprocess.CompletedProcess[str]:
    command = [*RLHF_COMMAND, *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A pair file, its prepared data, and a finished (one-step) SFT stage to start the reward model from."""
    root = tmp_path_factory.mktemp("rm-cli")
    rows = []
    for i in range(60):
        prompt = f"\n\nHuman: Can you help me with chore {i}?"
        rows.append(
            {
                "chosen": f"{prompt}\n\nAssistant: Of course, here is how to do chore {i} safely.",
                "rejected": f"{prompt}\n\nAssistant: No.",
            }
        )
    rows.append({"chosen": "no turns at all", "rejected": "still none"})  # unreadable as a pair
    (root / "pairs.jsonl").write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    config = load_config(PARAMS, [TINY], ["sft.max_steps=1"])
    run_prepare_data(config, root / "data", str(root / "pairs.jsonl"))
    run_sft(config, root / "data", root / "sft")
    return root


@pytest.mark.slow
def test_train_rm_then_score_pairs(workspace: Path) -> None:
    trained = rlhf(
        "train-rm",
        "-c",
        str(TINY),
        "-s",
        "reward.max_steps=2",
        "--data-dir",
        str(workspace / "data"),
        "--sft-dir",
        str(workspace / "sft"),
        "--out",
        str(workspace / "reward"),
    )
    assert trained.returncode == 0, trained.stderr
    assert "train-rm: trained 2 steps on" in trained.stdout and "validation accuracy" in trained.stdout
    metrics = json.loads((workspace / "reward" / "metrics.json").read_text())
    assert metrics["steps"] == 2 and 0 <= metrics["val/accuracy"] <= 1

    scored = rlhf(
        "score-pairs",
        "-c",
        str(TINY),
        "--model",
        str(workspace / "reward"),
        "--data",
        str(workspace / "pairs.jsonl"),
        "--out",
        str(workspace / "scores"),
    )
    assert scored.returncode == 0, scored.stderr
    (line,) = [line for line in scored.stdout.splitlines() if line.startswith("score-pairs: ")]  # the summary
    assert line.startswith("score-pairs: accuracy ") and "(95% CI " in line and "on 60 pairs" in line
    assert "left out 1 unreadable rows" in line
    assert "balanced accuracy" in line and "length-matched" in line and "length rule" in line
    written = json.loads((workspace / "scores" / "metrics.json").read_text())
    assert written["pairs"] == 60 and written["accuracy_low"] <= written["accuracy"] <= written["accuracy_high"]
    assert {"length_rule_accuracy", "length_matched_pairs", "auc_gain_over_length"} <= set(written)
    assert not any(name.startswith("val/") for name in written)
    assert (workspace / "scores" / "plots" / "reward_margin_hist.png").is_file()
    # The stage directory and its model/ are the same reward model.
    direct = score_pair_file(
        load_config(PARAMS, [TINY]), workspace / "reward" / "model", str(workspace / "pairs.jsonl")
    )
    assert direct.accuracy.accuracy == pytest.approx(written["accuracy"])


def test_score_pairs_names_a_directory_that_holds_no_reward_model(workspace: Path) -> None:
    with pytest.raises(FileNotFoundError, match="neither a saved reward model nor a train-rm output"):
        score_pair_file(load_config(PARAMS, [TINY]), workspace / "sft", str(workspace / "pairs.jsonl"))
