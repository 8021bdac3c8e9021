"""Checkpoints: full round trip (model, optimizer, scheduler, RNG, extra), atomic writes, rotation."""

import random
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from fixtures.parameters import small_llama
from rlhf_core.training import checkpoint
from rlhf_core.training.checkpoint import (
    MARKER_FILE,
    TEMPORARY_PREFIX,
    TrainingState,
    complete_checkpoints,
    latest_checkpoint,
    load_checkpoint,
    prune_checkpoints,
    save_checkpoint,
)
from rlhf_core.training.schedules import build_scheduler


def make_training(seed: int) -> tuple[nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, optimizer, build_scheduler(optimizer, "warmup_cosine", 10, 0.2, 0.1)


def take_steps(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler, count: int) -> None:
    for _ in range(count):
        model(torch.randn(3, 4)).square().mean().backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()


def random_draws() -> tuple[float, float, torch.Tensor]:
    return random.random(), float(np.random.rand()), torch.rand(3)


def test_round_trip_restores_model_optimizer_scheduler_rng_and_state(tmp_path: Path) -> None:
    model, optimizer, scheduler = make_training(seed=0)
    take_steps(model, optimizer, scheduler, 3)
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    extra = {"reward_mean": torch.tensor([0.25]), "count": 7, "name": "running"}
    state = TrainingState(step=3, best_metric=0.75, metrics={"loss": 1.5}, extra=extra)
    path = save_checkpoint(tmp_path, state, model, optimizer, scheduler)
    assert path == tmp_path / "step-00000003" and (path / MARKER_FILE).is_file()
    expected_draws = random_draws()
    take_steps(model, optimizer, scheduler, 2)  # the original run continues
    expected_weights = [p.detach().clone() for p in model.parameters()]

    restored_model, restored_optimizer, restored_scheduler = make_training(seed=99)
    loaded = load_checkpoint(path, restored_model, restored_optimizer, restored_scheduler)
    assert (loaded.step, loaded.best_metric, loaded.metrics) == (3, 0.75, {"loss": 1.5})
    assert loaded.extra["count"] == 7 and loaded.extra["name"] == "running"
    assert torch.equal(loaded.extra["reward_mean"], extra["reward_mean"])
    assert restored_scheduler.last_epoch == 3
    draws = random_draws()
    assert draws[:2] == expected_draws[:2] and torch.equal(draws[2], expected_draws[2])
    take_steps(restored_model, restored_optimizer, restored_scheduler, 2)  # the restored run continues
    for restored, expected in zip(restored_model.parameters(), expected_weights):
        assert torch.equal(restored, expected)


def test_crash_mid_write_leaves_only_an_ignored_temporary_directory(tmp_path: Path, monkeypatch) -> None:
    model, optimizer, scheduler = make_training(seed=0)
    save_checkpoint(tmp_path, TrainingState(step=1), model, optimizer, scheduler)

    def crash(directory: Path, step: int) -> None:
        raise RuntimeError("simulated crash before the marker")

    monkeypatch.setattr(checkpoint, "_write_marker", crash)
    with pytest.raises(RuntimeError, match="simulated crash"):
        save_checkpoint(tmp_path, TrainingState(step=2), model, optimizer, scheduler)
    leftovers = [p for p in tmp_path.iterdir() if p.name.startswith(TEMPORARY_PREFIX)]
    assert len(leftovers) == 1 and (leftovers[0] / "model.safetensors").is_file()
    assert not (tmp_path / "step-00000002").exists()
    assert latest_checkpoint(tmp_path) == tmp_path / "step-00000001"

    monkeypatch.undo()
    save_checkpoint(tmp_path, TrainingState(step=2), model, optimizer, scheduler)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000001", "step-00000002"]


def test_a_step_directory_without_marker_is_not_a_checkpoint(tmp_path: Path) -> None:
    model, optimizer, scheduler = make_training(seed=0)
    save_checkpoint(tmp_path, TrainingState(step=4), model, optimizer, scheduler)
    unmarked = tmp_path / "step-00000009"
    unmarked.mkdir()
    (unmarked / "model.safetensors").write_bytes(b"half")
    assert latest_checkpoint(tmp_path) == tmp_path / "step-00000004"
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        load_checkpoint(unmarked, model, optimizer, scheduler)
    prune_checkpoints(tmp_path, keep=None)
    assert not unmarked.exists()
    assert latest_checkpoint(tmp_path / "missing") is None


def test_rotation_keeps_the_newest_k(tmp_path: Path) -> None:
    model, optimizer, scheduler = make_training(seed=0)
    for step in (2, 4, 6, 8, 10):
        save_checkpoint(tmp_path, TrainingState(step=step), model, optimizer, scheduler, keep=3)
    names = [p.name for p in complete_checkpoints(tmp_path)]
    assert names == ["step-00000006", "step-00000008", "step-00000010"]
    with pytest.raises(ValueError, match="keep must be >= 1"):
        prune_checkpoints(tmp_path, keep=0)


def test_tied_embeddings_survive_the_round_trip(tmp_path: Path) -> None:
    model = small_llama(seed=0, tie_word_embeddings=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = build_scheduler(optimizer, "warmup_constant", 10, 0.1, 0.0)
    path = save_checkpoint(tmp_path, TrainingState(step=1), model, optimizer, scheduler)
    restored = small_llama(seed=1, tie_word_embeddings=True)
    restored_optimizer = torch.optim.AdamW(restored.parameters(), lr=1e-3)
    restored_scheduler = build_scheduler(restored_optimizer, "warmup_constant", 10, 0.1, 0.0)
    load_checkpoint(path, restored, restored_optimizer, restored_scheduler)
    assert restored.lm_head.weight is restored.model.embed_tokens.weight
    for (name, expected), actual in zip(model.state_dict().items(), restored.state_dict().values()):
        assert torch.equal(expected, actual), name
