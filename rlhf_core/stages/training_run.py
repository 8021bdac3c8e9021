"""What the training stages (SFT, reward model) share around the loop: logging, resume guard, settings.

* `ProgressLogger` adds the contract's `progress` metric (step / total, in [0, 1]) to every logged step.
* `RunState` is the loop's extra checkpoint state for a stage: a fingerprint of everything the run
  depends on (its config sections, the prepared data, the model it starts from), so that rerunning with
  different settings refuses to resume a checkpoint made with others, and figures measured before the
  first step (e.g. the base model's perplexity), so a resumed run does not recompute them.
* `loop_config` maps a stage's config section onto the loop's settings.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from rlhf_core.config import Config, TrainingConfig
from rlhf_core.stages.result import METRICS_FILE
from rlhf_core.training.logger import JsonlLogger, MetricsLogger, MultiLogger, RewindableLogger
from rlhf_core.training.loop import LoopConfig
from rlhf_core.training.schedules import ScheduleName

HISTORY_FILE = "history.jsonl"
CHECKPOINTS_DIR = "checkpoints"
MODEL_DIR = "model"


class ProgressLogger:
    """Forwards to `inner`, adding `progress = step / total_steps` to every `log_metrics` call."""

    def __init__(self, inner: MetricsLogger, total_steps: int) -> None:
        if total_steps < 1:
            raise ValueError(f"total_steps must be >= 1, got {total_steps}")
        self.inner = inner
        self.total_steps = total_steps

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.inner.log_metrics({**metrics, "progress": min(1.0, step / self.total_steps)}, step)

    def log_params(self, params: dict[str, Any]) -> None:
        self.inner.log_params(params)

    def truncate_after(self, step: int) -> None:
        """Rewind the inner logger's history when it can (a resumed run repeats no step)."""
        if isinstance(self.inner, RewindableLogger):
            self.inner.truncate_after(step)

    def close(self) -> None:
        self.inner.close()


def stage_logger(history: JsonlLogger, caller: MetricsLogger | None, total_steps: int) -> ProgressLogger:
    """What a stage hands the loop: history.jsonl plus the caller's logger (if any), with `progress` added."""
    return ProgressLogger(MultiLogger([history] if caller is None else [history, caller]), total_steps)


class ResumeMismatchError(RuntimeError):
    """The checkpoints in an output directory were made by a run with other settings or inputs."""


class RunState:
    """Extra checkpoint state of a stage: its input fingerprint and figures recorded during the run."""

    def __init__(self, fingerprint: str, checkpoint_dir: Path) -> None:
        self.fingerprint = fingerprint
        self.checkpoint_dir = checkpoint_dir
        self.values: dict[str, float] = {}

    def state_dict(self) -> dict[str, Any]:
        return {"fingerprint": self.fingerprint, "values": dict(self.values)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the recorded figures; refuse checkpoints of a run with a different fingerprint."""
        if state.get("fingerprint") != self.fingerprint:
            raise ResumeMismatchError(
                f"the checkpoints in {self.checkpoint_dir} come from a run with other settings or inputs "
                "(config section, model, seed or data changed); rerun with the original settings, or "
                "delete that directory (or choose another --out) to start over"
            )
        self.values = dict(state["values"])


def run_fingerprint(settings: dict[str, Any], files: Sequence[Path]) -> str:
    """sha256 of the settings (as sorted JSON) and of the bytes of each input file."""
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode())
    for path in files:
        digest.update(Path(path).read_bytes())
    return digest.hexdigest()


def stage_settings(config: Config, section: str) -> dict[str, Any]:
    """The config a training stage depends on: its own section, the base model, the seed, precision."""
    return {
        section: getattr(config, section).model_dump(mode="json"),
        "model": config.model.model_dump(mode="json"),
        "seed": config.seed,
        "bf16": config.distributed.bf16,
    }


def loop_config(
    section: TrainingConfig, config: Config, schedule: ScheduleName, min_lr_ratio: float = 1.0
) -> LoopConfig:
    """The loop settings of a stage's config section (the batch shape goes to the batch plan instead)."""
    return LoopConfig(
        epochs=section.epochs,
        max_steps=section.max_steps,
        lr=section.lr,
        weight_decay=section.weight_decay,
        schedule=schedule,
        warmup_ratio=section.warmup_ratio,
        min_lr_ratio=min_lr_ratio,
        max_grad_norm=section.max_grad_norm,
        checkpoint_every=section.checkpoint_every,
        keep_checkpoints=section.keep_checkpoints,
        eval_every=section.eval_every,
        eval_batches=section.eval_batches,
        seed=config.seed,
        bf16=config.distributed.bf16,
    )


def training_device() -> torch.device:
    """CUDA when available (bf16 autocast applies there), else the CPU (fp32)."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def mark_incomplete(out_dir: Path) -> None:
    """Remove a previous run's metrics.json: while the stage runs again, its output is not complete."""
    (Path(out_dir) / METRICS_FILE).unlink(missing_ok=True)
