"""Saving and loading causal LMs: safetensors only, chat template and end-of-turn kept, writes atomic."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlhf_core.atomic import atomic_directory
from rlhf_core.models.chat import render_prompt
from rlhf_core.models.loading import load_causal_lm
from rlhf_core.models.saving import save_causal_lm
from rlhf_core.models.tiny import build_tiny_model

DIALOGUE = [{"role": "user", "content": "Hello there"}]


def test_causal_lm_round_trip_keeps_weights_template_and_stop_token(tokenizer, tmp_path: Path) -> None:
    model = build_tiny_model(tokenizer, seed=5)
    model.generation_config.eos_token_id = 0  # saving must restore the end-of-turn stop
    save_causal_lm(model, tokenizer, tmp_path / "lm")
    loaded, loaded_tokenizer = load_causal_lm(tmp_path / "lm")

    names = {path.name for path in (tmp_path / "lm").iterdir()}
    assert "model.safetensors" in names and not any(name.endswith(".bin") for name in names)
    assert loaded.generation_config.eos_token_id == [2]
    assert loaded_tokenizer.chat_template == tokenizer.chat_template
    assert render_prompt(loaded_tokenizer, DIALOGUE) == render_prompt(tokenizer, DIALOGUE)
    ids = torch.tensor([tokenizer(render_prompt(tokenizer, DIALOGUE), add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)


def test_load_causal_lm_honours_dtype(tokenizer, tmp_path: Path) -> None:
    save_causal_lm(build_tiny_model(tokenizer), tokenizer, tmp_path / "lm")
    loaded, _ = load_causal_lm(tmp_path / "lm", dtype=torch.bfloat16, device="cpu")
    assert loaded.dtype == torch.bfloat16 and not loaded.training


def test_load_causal_lm_refuses_pickle_weights(tokenizer, tmp_path: Path) -> None:
    model = build_tiny_model(tokenizer)
    save_causal_lm(model, tokenizer, tmp_path / "lm")
    (tmp_path / "lm" / "model.safetensors").unlink()
    torch.save(model.state_dict(), tmp_path / "lm" / "pytorch_model.bin")
    with pytest.raises(OSError, match="safetensors"):
        load_causal_lm(tmp_path / "lm")


def test_atomic_directory_leaves_nothing_when_writing_fails(tmp_path: Path) -> None:
    target = tmp_path / "out"
    with pytest.raises(RuntimeError, match="crash"):
        with atomic_directory(target) as temp_dir:
            (temp_dir / "config.json").write_text("{}")
            raise RuntimeError("crash mid-save")
    assert list(tmp_path.iterdir()) == []


def test_atomic_directory_replaces_an_existing_directory_completely(tmp_path: Path) -> None:
    target = tmp_path / "out"
    with atomic_directory(target) as temp_dir:
        (temp_dir / "old.txt").write_text("old")
    with atomic_directory(target) as temp_dir:
        assert not (target / "new.txt").exists()  # nothing visible before the write completes
        (temp_dir / "new.txt").write_text("new")
    assert [path.name for path in target.iterdir()] == ["new.txt"]
    assert [path.name for path in tmp_path.iterdir()] == ["out"]
