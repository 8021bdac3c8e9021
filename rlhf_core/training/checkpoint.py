"""Exactly-resumable checkpoints: model, optimizer, scheduler, RNG states, step, best metric, extra state.

Layout: `<root>/step-00000123/` holds
  * `model.safetensors` - the model's tensors (tied weights stored once),
  * `training_state.pt` - optimizer, scheduler, RNG states, step, best metric, the step's metrics and the
    caller's extra state (read back with `torch.load(weights_only=True)`, so extra state must be made of
    tensors, numbers, strings, None, lists, tuples and dicts),
  * `COMPLETE` - the marker, written last.

Atomicity: everything is written into `<root>/.tmp-step-00000123-<pid>/`, files are fsynced, the marker
is written last and only then is the directory renamed to its final name with `os.replace`. A crash at
any moment therefore leaves either a complete `step-*` directory or a temporary one; `latest_checkpoint`
only accepts `step-*` directories that contain the marker, and `prune_checkpoints` deletes the rest.
One process writes a checkpoint root at a time.
"""

import os
import random
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_model, save_model
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

MODEL_FILE = "model.safetensors"
STATE_FILE = "training_state.pt"
MARKER_FILE = "COMPLETE"
TEMPORARY_PREFIX = ".tmp-"
_CHECKPOINT_NAME = re.compile(r"^step-(\d{8,})$")


@dataclass
class TrainingState:
    """The loop's own state at the end of optimizer step `step` (1-based: `step` updates are done)."""

    step: int
    best_metric: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)


def checkpoint_name(step: int) -> str:
    """`step-00000123`: zero-padded so that names sort like steps."""
    return f"step-{step:08d}"


def capture_rng_state() -> dict[str, Any]:
    """The state of every random generator a training step may draw from (python, numpy, torch, CUDA).

    The numpy key is stored as a list of ints so the whole state loads with `weights_only=True`.
    """
    numpy_state = np.random.get_state(legacy=False)
    numpy_state["state"]["key"] = numpy_state["state"]["key"].tolist()
    state: dict[str, Any] = {"python": random.getstate(), "numpy": numpy_state, "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Put every generator back to `state` (from `capture_rng_state`)."""
    random.setstate(state["python"])
    numpy_state = dict(state["numpy"])
    key = np.array(numpy_state["state"]["key"], dtype=np.uint32)
    numpy_state["state"] = dict(numpy_state["state"], key=key)
    np.random.set_state(numpy_state)
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def fsync_file(path: Path) -> None:
    """Flush a file's data to disk, so a power cut cannot reorder it after the marker."""
    with path.open("rb") as handle:
        os.fsync(handle.fileno())


def _fsync_directory(path: Path) -> None:
    """Flush a directory's entries (new names, renames) to disk."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _write_marker(directory: Path, step: int) -> None:
    """Written last: its presence is what makes a checkpoint directory count as complete."""
    marker = directory / MARKER_FILE
    marker.write_text(f"{step}\n")
    fsync_file(marker)


def save_checkpoint(
    root: str | Path,
    state: TrainingState,
    model: nn.Module,
    optimizer: Optimizer,
    scheduler: LRScheduler,
    keep: int | None = None,
) -> Path:
    """Atomically write the checkpoint of `state.step` under `root`, then keep the newest `keep` (None: all).

    Returns the final directory, `<root>/step-<step>`.
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / checkpoint_name(state.step)
    temporary = root / f"{TEMPORARY_PREFIX}{final.name}-{os.getpid()}"
    shutil.rmtree(temporary, ignore_errors=True)
    temporary.mkdir()
    # Contiguous copies only change how the file is laid out; loading copies into the model's own tensors.
    save_model(model, str(temporary / MODEL_FILE), force_contiguous=True)
    torch.save(
        {
            "step": state.step,
            "best_metric": state.best_metric,
            "metrics": state.metrics,
            "extra": state.extra,
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "rng": capture_rng_state(),
        },
        temporary / STATE_FILE,
    )
    fsync_file(temporary / MODEL_FILE)
    fsync_file(temporary / STATE_FILE)
    return publish_checkpoint(root, temporary, state.step, keep)


def publish_checkpoint(root: Path, temporary: Path, step: int, keep: int | None) -> Path:
    """Mark a fully written (and fsynced) temporary checkpoint complete and rename it to `step-<step>`.

    Then keep the newest `keep` complete checkpoints. Shared by the single-process checkpoints above
    and the DeepSpeed engine checkpoints of a multi-process run (rlhf_core/training/deepspeed_checkpoint.py).
    """
    final = root / checkpoint_name(step)
    _write_marker(temporary, step)
    _fsync_directory(temporary)
    # A complete directory of the same step can only be a leftover of an earlier run; replace it.
    shutil.rmtree(final, ignore_errors=True)
    os.replace(temporary, final)
    _fsync_directory(root)
    prune_checkpoints(root, keep)
    return final


def complete_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoint directories under `root` (named `step-*` and holding the marker), oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _CHECKPOINT_NAME.match(p.name) and (p / MARKER_FILE).is_file()]
    return sorted(found, key=checkpoint_step)


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest complete checkpoint under `root`, or None; ignores temporary and unmarked directories."""
    checkpoints = complete_checkpoints(root)
    return checkpoints[-1] if checkpoints else None


def checkpoint_step(path: str | Path) -> int:
    """The step a checkpoint directory holds, read from its name."""
    match = _CHECKPOINT_NAME.match(Path(path).name)
    if match is None:
        raise ValueError(f"{path} is not a checkpoint directory (expected a name like step-00000123)")
    return int(match.group(1))


def prune_checkpoints(root: str | Path, keep: int | None) -> None:
    """Delete temporary and incomplete directories, and all but the newest `keep` complete checkpoints."""
    if keep is not None and keep < 1:
        raise ValueError(f"keep must be >= 1 or None (keep all), got {keep}")
    root = Path(root)
    complete = complete_checkpoints(root)
    stale = complete[:-keep] if keep is not None else []
    for path in root.iterdir():
        if not path.is_dir():
            continue
        incomplete = _CHECKPOINT_NAME.match(path.name) and path not in complete
        if path.name.startswith(TEMPORARY_PREFIX) or incomplete or path in stale:
            shutil.rmtree(path)


def load_checkpoint(path: str | Path, model: nn.Module, optimizer: Optimizer, scheduler: LRScheduler) -> TrainingState:
    """Restore model, optimizer, scheduler and RNG states in place from `path`; return the loop's state."""
    path = Path(path)
    if not (path / MARKER_FILE).is_file():
        raise ValueError(f"{path} is not a complete checkpoint (no {MARKER_FILE} marker)")
    if not (path / MODEL_FILE).is_file():
        raise ValueError(
            f"{path} holds no {MODEL_FILE}: it is a DeepSpeed checkpoint of a multi-process run; resume it "
            "with the same distributed settings (distributed.num_processes, num_nodes)"
        )
    device = next(model.parameters()).device
    load_model(model, str(path / MODEL_FILE), strict=True, device=str(device))
    saved = torch.load(path / STATE_FILE, map_location="cpu", weights_only=True)
    optimizer.load_state_dict(saved["optimizer"])
    scheduler.load_state_dict(saved["scheduler"])
    restore_rng_state(saved["rng"])
    return TrainingState(
        step=saved["step"], best_metric=saved["best_metric"], metrics=saved["metrics"], extra=saved["extra"]
    )
