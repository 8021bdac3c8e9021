"""How the training commands start: their shared preamble, and the stage on one process or, when
`distributed.num_processes > 1`, under the deepspeed launcher.

`rlhf sft`, `rlhf train-rm` and `rlhf ppo` (and so `dvc repro`) behave the same either way: with several
processes configured they start the ranks through rlhf_core/distributed/launcher.py, print every rank's
lines prefixed with its rank, fail with the first failing rank's error, and read the finished stage's
metrics.json as the single-process path returns it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import typer

from rlhf_cli.options import resolve_config, stage_dir
from rlhf_core.config import Config
from rlhf_core.layout import MODEL_DIR
from rlhf_core.stages.result import StageResult, read_metrics
from rlhf_core.training.host_allocator import keep_freed_memory


@dataclass(frozen=True)
class TrainingOptions:
    """The options every training command takes: `--params`, `--config`, `-s`, `--out`, `--restart`."""

    params: Path
    config: list[Path] | None
    overrides: list[str] | None
    out: Path | None
    restart: bool


def start_training_command(stage: str, options: TrainingOptions) -> tuple[Config, Path]:
    """What every training command (`rlhf sft`, `train-rm`, `judge-rm`, `ppo`) does first: resolve the config,
    choose the output directory (`--out`, else the stage's under `artifacts/`) and, with `--restart`, discard
    its checkpoints.

    The config is resolved first, so a bad key fails before any checkpoint is deleted.
    """
    from rlhf_core.stages.training_run import discard_checkpoints  # inside: `rlhf --help` stays fast

    resolved = resolve_config(options.params, options.config, options.overrides)
    out_dir = stage_dir(options.out, stage)
    if options.restart:
        discard_checkpoints(out_dir, stage)
    return resolved, out_dir


def run_training_command(
    stage: str,
    options: TrainingOptions,
    run_here: Callable[..., StageResult],
    *,
    data_dir: Path,
    sft_dir: Path | None = None,
    rm_dir: Path | None = None,
) -> StageResult:
    """A launchable training command (`rlhf sft`, `train-rm`, `ppo`: `stage` sft | reward | ppo):
    `start_training_command`, then `run_here(config, out_dir=..., <the input directories given>)` on one
    process, else `stage` launched on the configured processes with the same inputs."""
    config, out_dir = start_training_command(stage, options)
    if config.distributed.world_size <= 1:
        keep_freed_memory()  # this process trains now (rlhf_core/training/host_allocator.py)
        inputs = {"data_dir": data_dir, "sft_dir": sft_dir, "rm_dir": rm_dir}
        return run_here(config, out_dir=out_dir, **{name: path for name, path in inputs.items() if path is not None})
    from rlhf_core.distributed.launcher import launch_stage

    launch_stage(stage, config, out_dir, echo_rank_line, data_dir=data_dir, sft_dir=sft_dir, rm_dir=rm_dir)
    return StageResult(out_dir=out_dir, metrics=read_metrics(out_dir), model_dir=out_dir / MODEL_DIR)


def echo_rank_line(rank: int | None, line: str) -> None:
    """One line of a launched run, on stderr, so stdout keeps only the command's summary."""
    typer.echo(f"[{'launcher' if rank is None else f'rank {rank}'}] {line}", err=True)
