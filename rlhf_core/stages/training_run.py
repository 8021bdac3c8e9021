"""What the training stages (SFT, reward model) share around the loop: logging, resume guard, settings.

* `ProgressLogger` adds the contract's `progress` metric (step / total, in [0, 1]) to every logged step.
* `RunInputs` is everything a run depends on (its config sections, the seed, the prepared data, the
  model it starts from). `check_resumable` compares it with `checkpoints/run_inputs.json`, the record
  of the run that made the checkpoints, before a rerun touches the output: a rerun with other settings
  would otherwise continue someone else's run and label the result with its own settings. A mismatch
  names what differs; `discard_checkpoints` (`--restart`) is the explicit way to start over.
* `RunState` is the loop's extra checkpoint state for a stage: the same fingerprint inside every
  checkpoint, and figures measured before the first step (e.g. the base model's perplexity), so a
  resumed run does not recompute them.
* `loop_logger`: history.jsonl (plus the caller's logger) on rank 0, nothing on the others.
* `file_sha256`, `model_dir_sha256`: how a run's inputs are identified (by content).
* `stage_lock`: the output lock (rlhf_core/output_lock.py) as the rank that writes the outputs holds it.
* `loop_config` maps a stage's config section onto the loop's settings.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rlhf_core.atomic import atomic_write_text
from rlhf_core.config import Config, TrainingConfig
from rlhf_core.distributed.context import rank_context
from rlhf_core.layout import CHECKPOINTS_DIR, HISTORY_FILE, METRICS_FILE
from rlhf_core.output_lock import output_lock
from rlhf_core.training.checkpoint import latest_checkpoint
from rlhf_core.training.logger import JsonlLogger, MetricsLogger, MultiLogger, NullLogger, RewindableLogger
from rlhf_core.training.loop_config import LoopConfig
from rlhf_core.training.schedules import ScheduleName

RUN_INPUTS_FILE = "run_inputs.json"
READ_CHUNK_BYTES = 1 << 20
MAX_LISTED_DIFFERENCES = 10
HOW_TO_PROCEED = (
    "to keep that output, run with another --out; to train from scratch in it, rerun with --restart "
    "(which deletes those checkpoints)"
)


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


@contextmanager
def loop_logger(
    out_dir: Path, caller: MetricsLogger | None, total_steps: int, is_main: bool
) -> Iterator[MetricsLogger]:
    """The logger a stage hands the loop, closed afterwards: on rank 0 `stage_logger` over out_dir's
    history.jsonl; on the other ranks, which write nothing, a NullLogger."""
    if not is_main:
        yield NullLogger()
        return
    history = JsonlLogger(Path(out_dir) / HISTORY_FILE)
    try:
        yield stage_logger(history, caller, total_steps)
    finally:
        history.close()


class ResumeMismatchError(RuntimeError):
    """The checkpoints in an output directory were made by a run with other settings or inputs."""


@dataclass(frozen=True)
class RunInputs:
    """What a training run depends on: its settings, and the sha256 of each input it reads, by name."""

    settings: dict[str, Any]
    inputs: dict[str, str]

    def record(self) -> dict[str, Any]:
        """The JSON form, as `checkpoints/run_inputs.json` holds it."""
        return json.loads(json.dumps({"settings": self.settings, "inputs": self.inputs}, default=str))

    @property
    def fingerprint(self) -> str:
        return hashlib.sha256(json.dumps(self.record(), sort_keys=True).encode()).hexdigest()

    def differences(self, recorded: dict[str, Any]) -> list[str]:
        """What differs from a recorded run: `key.path: old -> new` per setting, then each changed input."""
        old_settings = _flatten(recorded.get("settings", {}))
        new_settings = _flatten(self.record()["settings"])
        changed = [
            f"{key}: {old_settings.get(key, '(unset)')!r} -> {new_settings.get(key, '(unset)')!r}"
            for key in sorted(old_settings.keys() | new_settings.keys())
            if old_settings.get(key) != new_settings.get(key)
        ]
        old_inputs = recorded.get("inputs", {})
        changed += [
            f"{name} changed (sha256 {old_inputs[name][:12]} -> {digest[:12]})"
            if name in old_inputs
            else f"{name} not recorded by that run (it identified its inputs otherwise)"
            for name, digest in self.inputs.items()
            if old_inputs.get(name) != digest
        ]
        return changed


def _flatten(settings: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested settings as `{"a.b": value}`."""
    flat: dict[str, Any] = {}
    for key, value in settings.items():
        if isinstance(value, dict):
            flat |= _flatten(value, f"{prefix}{key}.")
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def file_sha256(path: Path) -> str:
    """sha256 of a file's bytes."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def model_dir_sha256(model_dir: Path) -> str:
    """One sha256 over the relative path and the sha256 of every file of a model directory, sorted.

    The same digest as the orchestration layer's `directory_sha256` of a model directory (the registry's
    content tag), so a registered reward model and a PPO run's record can be compared.
    """
    digest = hashlib.sha256()
    for path in sorted(item for item in Path(model_dir).rglob("*") if item.is_file()):
        file_digest = hashlib.sha256()
        with path.open("rb") as handle:
            while chunk := handle.read(READ_CHUNK_BYTES):
                file_digest.update(chunk)
        digest.update(path.relative_to(model_dir).as_posix().encode() + b"\0")
        digest.update(file_digest.hexdigest().encode() + b"\n")
    return digest.hexdigest()


def check_resumable(checkpoint_dir: Path, inputs: RunInputs) -> None:
    """Raise `ResumeMismatchError`, before anything is written, when the checkpoints in `checkpoint_dir`
    were made by a run with other inputs (or by a version that did not record them)."""
    if latest_checkpoint(checkpoint_dir) is None:
        return  # nothing to resume: the run starts fresh and records its own inputs
    record = Path(checkpoint_dir) / RUN_INPUTS_FILE
    if not record.is_file():
        raise ResumeMismatchError(
            f"the checkpoints in {checkpoint_dir} do not record the settings and inputs that made them "
            f"(no {RUN_INPUTS_FILE}: an older version wrote them), so resuming them could mislabel the "
            f"result; {HOW_TO_PROCEED}"
        )
    differences = inputs.differences(json.loads(record.read_text(encoding="utf-8")))
    if differences:
        listed = "; ".join(differences[:MAX_LISTED_DIFFERENCES])
        more = len(differences) - MAX_LISTED_DIFFERENCES
        raise ResumeMismatchError(
            f"the checkpoints in {checkpoint_dir} come from a run with other settings or inputs: {listed}"
            f"{f' (and {more} more)' if more > 0 else ''}. Rerun with the original settings to resume it; "
            f"{HOW_TO_PROCEED}"
        )


def record_run_inputs(checkpoint_dir: Path, inputs: RunInputs) -> None:
    """Write `checkpoints/run_inputs.json` as the run starts writing (before its first checkpoint)."""
    atomic_write_text(Path(checkpoint_dir) / RUN_INPUTS_FILE, json.dumps(inputs.record(), indent=2) + "\n")


def discard_checkpoints(out_dir: Path, stage: str) -> None:
    """`--restart`: delete the checkpoints of `out_dir` (under its lock), so the next run starts fresh."""
    with output_lock(Path(out_dir), stage):
        shutil.rmtree(Path(out_dir) / CHECKPOINTS_DIR, ignore_errors=True)


def stage_lock(out_dir: Path, stage: str) -> AbstractContextManager[object]:
    """The lock of `out_dir` for the whole stage, held by rank 0, the rank that writes the outputs.

    The other ranks of a launched stage write nothing there; they run under rank 0's lock.
    """
    return output_lock(Path(out_dir), stage) if rank_context().is_main else nullcontext()


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
                f"{HOW_TO_PROCEED}"
            )
        self.values = dict(state["values"])


def stage_settings(config: Config, section: str) -> dict[str, Any]:
    """The config a training stage depends on: its own section, the base model, the seed, the precision it
    resolved to (bf16 or not), and the number of ranks (batch sizes are per rank, so it sets the global batch)."""
    return {
        section: getattr(config, section).model_dump(mode="json"),
        "model": config.model.model_dump(mode="json"),
        "seed": config.seed,
        "bf16": config.distributed.uses_bf16,
        "world_size": config.distributed.world_size,
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
        bf16=config.distributed.uses_bf16,
    )


def training_device() -> torch.device:
    """CUDA when available, else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def mark_incomplete(out_dir: Path) -> None:
    """Remove a previous run's metrics.json: while the stage runs again, its output is not complete."""
    (Path(out_dir) / METRICS_FILE).unlink(missing_ok=True)
