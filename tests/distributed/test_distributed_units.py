"""The single-process building blocks of rlhf_core/distributed: rank context, sharding, collectives.

With one process the collectives return their input's value, which is what keeps the single-process
path unchanged; their multi-rank behaviour is covered by the 2-process equivalence tests, and
`computed_on_main`'s and `leave_process_group`'s by two gloo processes here.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fixtures.gloo_ranks import on_two_gloo_ranks
from rlhf_core.config import DistributedConfig
from rlhf_core.distributed.collectives import (
    computed_on_main,
    gather_moments,
    global_masked_mean_var,
    sum_counts,
    sum_metrics,
)
from rlhf_core.distributed.context import (
    RankContext,
    RankEnvironmentError,
    leave_process_group,
    rank_context,
    stage_context,
)
from rlhf_core.distributed.sharding import shard
from rlhf_core.ppo.masked import masked_mean, masked_var


def test_rank_context_reads_the_launcher_environment() -> None:
    assert rank_context({}) == RankContext(rank=0, world_size=1, local_rank=0)
    context = rank_context({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1"})
    assert (context.rank, context.world_size, context.local_rank, context.is_main) == (3, 4, 1, False)
    with pytest.raises(RankEnvironmentError, match="RANK=4, WORLD_SIZE=4"):
        rank_context({"RANK": "4", "WORLD_SIZE": "4"})
    with pytest.raises(RankEnvironmentError, match="WORLD_SIZE='two'"):
        rank_context({"WORLD_SIZE": "two"})


def test_a_multi_process_config_refuses_to_run_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    assert stage_context(DistributedConfig()).world_size == 1
    with pytest.raises(RankEnvironmentError, match="num_processes \\* num_nodes = 2, but this process was not started"):
        stage_context(DistributedConfig(num_processes=2))


def test_shards_are_disjoint_strided_and_cover_the_step() -> None:
    step = [[0, 1], [2, 3], [4, 5], [6, 7]]
    shards = [shard(step, RankContext(rank, 2, rank)) for rank in range(2)]
    assert shards == [[[0, 1], [4, 5]], [[2, 3], [6, 7]]]
    assert sorted(shards[0] + shards[1]) == step
    with pytest.raises(ValueError, match="cannot split 3 items evenly over 2 ranks"):
        shard([1, 2, 3], RankContext(0, 2, 0))


def test_collectives_of_one_process_return_their_input() -> None:
    assert sum_counts({"tokens": 7, "pairs": 2}) == {"tokens": 7, "pairs": 2}
    assert sum_metrics({"loss": 0.1 + 0.2}) == {"loss": 0.1 + 0.2}
    assert gather_moments((3, 1.5, 0.25)) == [(3, 1.5, 0.25)]
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, generator=generator)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    mean, var = global_masked_mean_var(x, mask)
    torch.testing.assert_close(mean, masked_mean(x, mask), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(var, masked_var(x, mask), rtol=1e-6, atol=1e-7)


def hash_on_main_rank(rank: int) -> dict:
    """One rank of `computed_on_main`'s test: rank 0 answers (and then fails); what each rank got is returned."""
    calls = []
    answer = computed_on_main(lambda: calls.append(rank) or f"hashed by rank {rank}")
    try:
        computed_on_main(lambda: 1 / 0)
        failure = "none"
    except ZeroDivisionError as error:
        failure = type(error).__name__
    leave_process_group()
    left = not torch.distributed.is_initialized()
    return {"answer": answer, "calls": calls, "failure": failure, "left": left}


@pytest.mark.slow  # two gloo processes
def test_computed_on_main_runs_on_rank_0_alone_and_every_rank_gets_its_answer_or_its_error(tmp_path: Path) -> None:
    got = on_two_gloo_ranks(hash_on_main_rank, tmp_path)
    assert got == [
        {"answer": "hashed by rank 0", "calls": [0], "failure": "ZeroDivisionError", "left": True},
        {"answer": "hashed by rank 0", "calls": [], "failure": "ZeroDivisionError", "left": True},
    ]
    assert computed_on_main(lambda: "alone") == "alone"  # one process: just the call
    leave_process_group()  # one process, no group: nothing to leave
