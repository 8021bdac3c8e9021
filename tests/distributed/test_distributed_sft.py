"""SFT on 2 CPU processes (gloo, DeepSpeed ZeRO-2 engine, the real launcher) == SFT on 1 process.

Two ranks with a per-rank batch of B = 2 sequences (one micro-batch each) against one process with a
batch of 2B = 4 sequences, fixed-size batches: both plans cut the same seeded permutation into the same
4 sequences per step, so the losses, gradient norms, validation figures and final weights must agree. Tolerance 1e-5:
absolute on losses of ~10.8, relative norm per tensor on weights (`assert_same_weights`); that covers
what float32 summation order and padding to another batch width leave, while a wrong normalisation
(per-rank instead of global token counts) or a missing gradient reduction is off by 1e-2 or more.
Gradient norms agree to 1e-4 relative: the single process takes torch's float32 `clip_grad_norm_` over a
3 M-entry embedding gradient, 1.5e-5 off the float64 norm, which the engine's partitioned sum matches.
Each rank's log must report world size 2 and the ranks' samples must be disjoint at every step.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fixtures.distributed_runs import (
    RankLog,
    assert_disjoint_shards,
    assert_no_shared_buffers_left,
    assert_same_weights,
    read_history,
)
from fixtures.servers import free_port
from fixtures.tiny_ppo import tiny_config
from rlhf_core.distributed.launcher import launch_stage
from rlhf_core.stages.sft import run_sft

pytestmark = pytest.mark.usefixtures("one_thread")

TOLERANCE = 1e-5
GRAD_NORM_RELATIVE = 1e-4
STEPS = 3
COMMON = [
    f"sft.max_steps={STEPS}",
    "sft.grad_accum_steps=1",
    "sft.eval_every=100",
    "sft.checkpoint_every=2",
    "sft.batching=fixed",  # length-grouped steps depend on the micro-batch size (infra/deepspeed/README.md)
]


@pytest.mark.slow
def test_two_ranks_with_batch_b_match_one_process_with_batch_2b(
    data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    single = run_sft(tiny_config(*COMMON, "sft.micro_batch_size=4"), data_dir, tmp_path / "single")

    monkeypatch.setenv("RLHF_LOG_LEVEL", "DEBUG")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    port = free_port()
    two_ranks = tiny_config(
        *COMMON, "sft.micro_batch_size=2", "distributed.num_processes=2", f"distributed.master_port={port}"
    )
    log = RankLog()
    launch_stage("sft", two_ranks, tmp_path / "two", log, data_dir=data_dir)
    assert_no_shared_buffers_left(port)

    assert log.world_sizes() == {0: 2, 1: 2}
    assert_disjoint_shards(log.samples(), world_size=2)
    assert sorted(log.samples()) == list(range(1, STEPS + 1))

    one, two = (read_history(tmp_path / "single" / "history.jsonl"), read_history(tmp_path / "two" / "history.jsonl"))
    assert [row["step"] for row in two] == [row["step"] for row in one] == list(range(1, STEPS + 1))
    for row_one, row_two in zip(one, two):
        for key in ("loss", "lr"):
            assert row_two[key] == pytest.approx(row_one[key], abs=TOLERANCE), (row_one["step"], key)
        assert row_two["grad_norm"] == pytest.approx(row_one["grad_norm"], rel=GRAD_NORM_RELATIVE)
    assert two[-1]["val/nll"] == pytest.approx(one[-1]["val/nll"], abs=TOLERANCE)

    metrics = json.loads((tmp_path / "two" / "metrics.json").read_text())
    for key in ("train_loss", "nll_before", "nll_after"):
        assert metrics[key] == pytest.approx(single.metrics[key], abs=TOLERANCE), key
    assert_same_weights(tmp_path / "single" / "model", tmp_path / "two" / "model", TOLERANCE)
    assert (tmp_path / "two" / "checkpoints" / "step-00000003" / "model").is_dir()  # the engine's shards
