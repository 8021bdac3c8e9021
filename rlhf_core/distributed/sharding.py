"""Data sharding: each rank takes a disjoint, deterministic share of every optimizer step's samples.

The batch plans (rlhf_core/training/batching.py) and the PPO prompt stream are built for the GLOBAL
batch, the same on every rank (they are pure functions of the seed and the data). Each rank then takes
every `world_size`-th item of a step, starting at its rank: rank r of W gets items r, r + W, r + 2W, ...
So the ranks' shares are disjoint, together they are exactly the step's items, and a run with W ranks
and per-rank batch B sees the same samples per step as one process with batch W * B.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

from rlhf_core.distributed.context import RankContext

Item = TypeVar("Item")


def shard(items: Sequence[Item], context: RankContext) -> list[Item]:
    """Rank `context.rank`'s share of `items`: every `world_size`-th item from position `rank`.

    `len(items)` must be a multiple of the world size, so every rank does the same number of
    forward/backward passes (the collectives of the step would otherwise wait forever).
    """
    if len(items) % context.world_size:
        raise ValueError(
            f"cannot split {len(items)} items evenly over {context.world_size} ranks; the global batch must "
            "be a multiple of distributed.num_processes * num_nodes"
        )
    return list(items[context.rank :: context.world_size])
