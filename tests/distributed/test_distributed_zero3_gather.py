"""Under ZeRO-3 the PPO policy's weights are gathered once per rollout for generation, not once per token.

Two CPU processes (gloo) run tests/scripts/distributed_zero3_rollout.py under the real launcher: the
trainer of the PPO stage with a ZeRO-3 policy engine does two rollouts (an update after each), with either
rollout engine. Per rollout, each rank must gather the whole policy exactly once and run no all-gather at
all while the engine generates; the control, `generate` on the partitioned policy without that gather,
all-gathers weights at least once per generated token (which is what the single gather saves). After the
updates the engine, synced inside the gather, still draws `generate`'s tokens on the updated policy.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fixtures.distributed_runs import RankLog
from fixtures.paths import SCRIPTS
from fixtures.servers import free_port
from fixtures.tiny_ppo import StageInputs
from rlhf_core.config import DistributedConfig
from rlhf_core.distributed.launcher import Launch, run_launch

ROLLOUTS = 2


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["hf", "lean"])
def test_one_whole_policy_gather_per_rollout_and_none_inside_generate(
    inputs: StageInputs, tmp_path: Path, engine: str
) -> None:
    log = RankLog()
    args = ["--data-dir", str(inputs.data_dir), "--sft-dir", str(inputs.sft_dir), "--rm-dir", str(inputs.rm_dir)]
    spec = Launch(
        module="distributed_zero3_rollout",
        args=[*args, "--rollouts", str(ROLLOUTS), "--engine", engine],
        distributed=DistributedConfig(num_processes=2, zero_stage=3, master_port=free_port()),
        log_dir=tmp_path / "logs",
        env={"PYTHONPATH": str(SCRIPTS), "OMP_NUM_THREADS": "1"},
    )
    run_launch(spec, log)

    results = {rank: json.loads(line.removeprefix("ZERO3 ")) for rank, line in log.lines if line.startswith("ZERO3 ")}
    assert sorted(results) == [0, 1]
    for rank, result in results.items():
        assert (result["rank"], result["world_size"], result["partitioned"]) == (rank, 2, True)
        assert len(result["rollouts"]) == ROLLOUTS
        for rollout in result["rollouts"]:
            assert rollout["whole_model_gathers"] == 1, (rank, rollout)
            assert rollout["all_gathers_during_generate"] == 0, (rank, rollout)
            assert rollout["generated_columns"] >= 1
        assert result["control_all_gathers_during_generate"] >= result["control_generated_columns"] >= 1
        assert result["same_tokens_as_generate_after_update"], rank
