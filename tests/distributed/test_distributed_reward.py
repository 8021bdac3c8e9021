"""Reward-model training on 2 CPU processes (gloo, DeepSpeed ZeRO-2, the real launcher) == on 1 process.

Two ranks with a per-rank batch of B = 2 pairs against one process with 2B = 4 pairs per step: the same
pairs per step, so the eq. (2) losses, the training accuracy and margin, the validation figures of the
selected model and its weights must agree. Tolerance 1e-5: absolute on losses and figures, relative
norm per tensor on weights (`assert_same_weights`), as in test_distributed_sft.py; normalising by the
rank's pair count instead of the global one would be off by a factor of 2 in the ranking term. Each rank
reports world size 2 and the ranks' pairs are disjoint at every step.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fixtures.distributed_runs import RankLog, assert_disjoint_shards, assert_same_weights, read_history
from fixtures.servers import free_port
from fixtures.tiny_ppo import StageInputs, tiny_config  # noqa: F401
from rlhf_core.distributed.launcher import launch_stage
from rlhf_core.stages.reward import run_train_rm

pytestmark = pytest.mark.usefixtures("one_thread")

TOLERANCE = 1e-5
STEPS = 3
COMMON = [
    f"reward.max_steps={STEPS}",
    "reward.grad_accum_steps=1",
    "reward.eval_every=100",
    "reward.batching=fixed",  # length-grouped steps depend on the micro-batch size (infra/deepspeed/README.md)
]
STEP_KEYS = ("loss", "ranking_loss", "lm_loss", "accuracy", "margin", "lr")
FINAL_KEYS = ("val/accuracy", "val/margin_mean", "val/loss", "val/ranking_loss", "val/lm_loss", "train_loss")


@pytest.mark.slow
def test_two_ranks_with_batch_b_match_one_process_with_batch_2b(
    inputs: StageInputs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:

    single = run_train_rm(
        tiny_config(*COMMON, "reward.micro_batch_size=4"), inputs.data_dir, inputs.sft_dir, tmp_path / "single"
    )

    monkeypatch.setenv("RLHF_LOG_LEVEL", "DEBUG")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    two_ranks = tiny_config(
        *COMMON, "reward.micro_batch_size=2", "distributed.num_processes=2", f"distributed.master_port={free_port()}"
    )
    log = RankLog()
    launch_stage("reward", two_ranks, tmp_path / "two", log, data_dir=inputs.data_dir, sft_dir=inputs.sft_dir)

    assert log.world_sizes() == {0: 2, 1: 2}
    assert_disjoint_shards(log.samples(), world_size=2)
    assert sorted(log.samples()) == list(range(1, STEPS + 1))

    one, two = (read_history(tmp_path / "single" / "history.jsonl"), read_history(tmp_path / "two" / "history.jsonl"))
    assert [row["step"] for row in two] == [row["step"] for row in one] == list(range(1, STEPS + 1))
    for row_one, row_two in zip(one, two):
        for key in STEP_KEYS:
            assert row_two[key] == pytest.approx(row_one[key], abs=TOLERANCE), (row_one["step"], key)

    metrics = json.loads((tmp_path / "two" / "metrics.json").read_text())
    for key in FINAL_KEYS:
        assert metrics[key] == pytest.approx(single.metrics[key], abs=TOLERANCE), key
    assert_same_weights(tmp_path / "single" / "model", tmp_path / "two" / "model", TOLERANCE)
