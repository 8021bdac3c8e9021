"""Checkpoints of DeepSpeed engines: every rank writes its shard, rank 0 makes the checkpoint complete.

Same layout and atomicity as the single-process checkpoints (rlhf_core/training/checkpoint.py): a
`step-<step>/` directory counts only once its `COMPLETE` marker exists, and it gets its final name by a
rename. Inside it:
  * `<engine name>/` - `engine.save_checkpoint` output: weights, the ZeRO-partitioned optimizer state
    (one file per rank) and the lr schedule,
  * `rng-rank<r>.pt` - each rank's random-generator states (ranks sample differently),
  * `training_state.pt` - the loop's state (step, best metric, metrics, extra) and the world size.

A run resumes only with the world size it was saved with (ZeRO shards are per rank). All ranks must
share the checkpoint directory (one file system; on several nodes a shared mount).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

from rlhf_core.distributed.context import RankContext
from rlhf_core.training.checkpoint import (
    STATE_FILE,
    TEMPORARY_PREFIX,
    TrainingState,
    capture_rng_state,
    checkpoint_name,
    fsync_file,
    publish_checkpoint,
    restore_rng_state,
)


def _barrier() -> None:
    torch.distributed.barrier()


def _rng_file(directory: Path, rank: int) -> Path:
    return directory / f"rng-rank{rank}.pt"


def save_engine_checkpoint(
    root: Path, state: TrainingState, engines: dict[str, Any], keep: int | None, context: RankContext
) -> Path:
    """Collective: write `engines` and `state` as `<root>/step-<step>/`, keep the newest `keep`."""
    root = Path(root)
    temporary = root / f"{TEMPORARY_PREFIX}{checkpoint_name(state.step)}"
    if context.is_main:
        shutil.rmtree(temporary, ignore_errors=True)
        temporary.mkdir(parents=True)
    _barrier()
    for name, engine in engines.items():
        engine.save_checkpoint(str(temporary), tag=name, save_latest=False)
    torch.save(capture_rng_state(), _rng_file(temporary, context.rank))
    fsync_file(_rng_file(temporary, context.rank))
    _barrier()
    final = root / checkpoint_name(state.step)
    if context.is_main:
        torch.save(
            {
                "step": state.step,
                "best_metric": state.best_metric,
                "metrics": state.metrics,
                "extra": state.extra,
                "world_size": context.world_size,
            },
            temporary / STATE_FILE,
        )
        fsync_file(temporary / STATE_FILE)
        publish_checkpoint(root, temporary, state.step, keep)
    _barrier()
    return final


def restore_engine_checkpoint(path: Path, engines: dict[str, Any], context: RankContext) -> TrainingState:
    """Collective: load `engines` and this rank's RNG states from `path`; returns the loop's state."""
    path = Path(path)
    saved = torch.load(path / STATE_FILE, map_location="cpu", weights_only=True)
    if saved.get("world_size") != context.world_size:
        saved_by = f"{saved['world_size']} ranks" if "world_size" in saved else "a single-process run"
        raise ValueError(
            f"{path} was saved by {saved_by}; this run has {context.world_size} ranks. Resume with the "
            "original distributed settings, or start over in a new output directory"
        )
    for name, engine in engines.items():
        loaded, _ = engine.load_checkpoint(
            str(path), tag=name, load_optimizer_states=True, load_lr_scheduler_states=True
        )
        if loaded is None:
            raise ValueError(f"{path}: no DeepSpeed checkpoint of engine {name!r}")
    restore_rng_state(torch.load(_rng_file(path, context.rank), map_location="cpu", weights_only=True))
    return TrainingState(
        step=saved["step"], best_metric=saved["best_metric"], metrics=saved["metrics"], extra=saved["extra"]
    )
