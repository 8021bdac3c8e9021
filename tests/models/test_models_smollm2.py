"""The packaged SmolLM2: GGUF -> safetensors cache conversion, and that the result is the real chat model.

The conversion tests read the GGUF once per module (~20-40 s on 2 CPUs: slow) and convert it into a
temporary cache directory. The others load the user's cache as every command does (`cached`; the suite's
tokenizer fixture has converted it already, or converts it on a fresh machine).
"""

from __future__ import annotations

import builtins
import json
import math
from pathlib import Path

import gguf
import pytest
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from rlhf_core.models import gguf_cache, smollm2
from rlhf_core.models.chat import encode_conversation, encode_prompt, end_of_turn_id, render_prompt
from rlhf_core.models.tiny import build_tiny_model, load_tiny_model

PARAGRAPH = (
    "The library opens at nine in the morning and closes at six in the evening. Visitors can borrow up to "
    "five books at a time, and each loan lasts for two weeks. If you need a book for longer, you can renew it "
    "online or at the front desk. Children under twelve must be accompanied by an adult, and food is not "
    "allowed in the reading rooms."
)
# A random model predicts close to uniformly over 49152 tokens (perplexity ~ vocabulary size); a
# working language model predicts plain English with perplexity in the tens.
PERPLEXITY_BOUND = 100.0
DIALOGUE = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def gguf_loaded() -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    return smollm2.load_gguf_smollm2()


@pytest.fixture(scope="module")
def cache_dir(
    gguf_loaded: tuple[PreTrainedModel, PreTrainedTokenizerBase], tmp_path_factory: pytest.TempPathFactory
) -> Path:
    model, tokenizer = gguf_loaded
    return smollm2.write_smollm2_cache(model, tokenizer, tmp_path_factory.mktemp("cache") / "smollm2")


@pytest.fixture(scope="module")
def converted(cache_dir: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    return smollm2.load_smollm2(cache_dir)


@pytest.fixture(scope="module")
def cached() -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    return smollm2.load_smollm2()


def perplexity(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, text: str) -> float:
    """exp of the mean next-token negative log-likelihood, computed by hand from the logits."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        log_probs = torch.log_softmax(model(torch.tensor([ids])).logits[0], dim=-1)
    nll = [-float(log_probs[t, ids[t + 1]]) for t in range(len(ids) - 1)]
    return math.exp(sum(nll) / len(nll))


@pytest.mark.slow
def test_cached_copy_gives_the_gguf_logits(gguf_loaded, converted) -> None:
    (gguf_model, tokenizer), (cached_model, _) = gguf_loaded, converted
    ids = torch.tensor([tokenizer(PARAGRAPH, add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        expected, actual = gguf_model(ids).logits, cached_model(ids).logits
    assert cached_model.dtype == torch.float32
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-6)


@pytest.mark.slow
def test_cache_is_plain_safetensors_with_a_marker(cache_dir: Path) -> None:
    names = {path.name for path in cache_dir.iterdir()}
    assert "model.safetensors" in names and gguf_cache.MARKER_FILE in names
    assert not any(name.endswith((".bin", ".pt", ".gguf")) for name in names)
    assert json.loads((cache_dir / gguf_cache.MARKER_FILE).read_text())["source"] == smollm2.GGUF_FILE_NAME
    assert not (cache_dir / "config.json").read_text().count("quantization_config")
    assert [path.name for path in cache_dir.parent.iterdir()] == [cache_dir.name]  # no temp dir left behind


@pytest.mark.slow
def test_cached_tokenizer_matches_the_gguf_tokenizer(gguf_loaded, converted) -> None:
    (_, gguf_tokenizer), (_, cached_tokenizer) = gguf_loaded, converted
    assert cached_tokenizer.chat_template == gguf_tokenizer.chat_template
    assert render_prompt(cached_tokenizer, DIALOGUE) == render_prompt(gguf_tokenizer, DIALOGUE)
    assert cached_tokenizer(PARAGRAPH)["input_ids"] == gguf_tokenizer(PARAGRAPH)["input_ids"]
    expected = encode_conversation(gguf_tokenizer, DIALOGUE, "Paris.")
    assert encode_conversation(cached_tokenizer, DIALOGUE, "Paris.") == expected


def test_second_load_never_opens_the_gguf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache_dir = smollm2.ensure_smollm2_cache()  # converted before the spies are set, if it is not yet
    gguf_path = tmp_path / smollm2.GGUF_FILE_NAME
    gguf_path.write_bytes(b"")
    opened: list[str] = []
    real_open = builtins.open

    def spy_open(file, *args, **kwargs):
        if isinstance(file, (str, Path)) and Path(file).name == gguf_path.name:
            opened.append(str(file))
        return real_open(file, *args, **kwargs)

    def refuse_reader(*args, **kwargs):
        opened.append("GGUFReader")
        raise AssertionError("GGUFReader used")

    monkeypatch.setattr(builtins, "open", spy_open)
    monkeypatch.setattr(gguf, "GGUFReader", refuse_reader)
    monkeypatch.setattr(gguf.gguf_reader, "GGUFReader", refuse_reader)

    model, tokenizer = smollm2.load_smollm2(cache_dir)
    assert smollm2.ensure_smollm2_cache(cache_dir) == cache_dir
    assert model.config.num_hidden_layers == 30 and len(tokenizer) == 49152
    assert opened == []
    spy_open(gguf_path, "rb").close()  # the spy itself works: opening the GGUF through it is recorded
    assert opened == [str(gguf_path)]


@pytest.mark.slow  # it writes the GGUF's model; a complete cache is never converted again: the test above
def test_ensure_converts_once_into_an_empty_directory(
    gguf_loaded, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []

    def counted_load():
        calls.append(1)
        return gguf_loaded

    monkeypatch.setattr(smollm2, "load_gguf_smollm2", counted_load)
    target = tmp_path / "models" / "smollm2"
    assert smollm2.ensure_smollm2_cache(target) == target
    assert smollm2.ensure_smollm2_cache(target) == target
    assert calls == [1]
    assert smollm2.is_cache_complete(target)


def test_cache_dir_follows_the_environment_variable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(gguf_cache.CACHE_ENV_VAR, str(tmp_path))
    assert smollm2.default_cache_dir() == tmp_path / "models" / "smollm2-135m-instruct"
    monkeypatch.delenv(gguf_cache.CACHE_ENV_VAR)
    assert smollm2.default_cache_dir() == Path.home() / ".cache/rlhf-pipeline/models/smollm2-135m-instruct"


def test_a_foreign_directory_is_never_taken_for_a_cache(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileExistsError, match=gguf_cache.MARKER_FILE):
        smollm2.ensure_smollm2_cache(tmp_path)


def test_real_model_has_low_perplexity_and_random_weights_do_not(cached) -> None:
    model, tokenizer = cached
    real = perplexity(model, tokenizer, PARAGRAPH)
    random = perplexity(build_tiny_model(tokenizer, seed=0), tokenizer, PARAGRAPH)
    assert real < PERPLEXITY_BOUND < random
    assert random > len(tokenizer) / 4  # random weights are near-uniform over the vocabulary


def test_greedy_chat_turn_stops_at_end_of_turn(cached) -> None:
    model, tokenizer = cached
    prompt_ids = torch.tensor([encode_prompt(tokenizer, DIALOGUE)])
    with torch.no_grad():
        output = model.generate(
            prompt_ids, attention_mask=torch.ones_like(prompt_ids), max_new_tokens=30, do_sample=False
        )
    new_ids = output[0, prompt_ids.shape[1] :].tolist()
    text = tokenizer.decode(new_ids, skip_special_tokens=True)
    assert text.strip()
    assert "Paris" in text
    eot = end_of_turn_id(tokenizer)
    assert model.generation_config.eos_token_id == [eot]
    if len(new_ids) < 30:
        assert new_ids[-1] == eot and eot not in new_ids[:-1]


def test_tiny_model_renders_chats_exactly_like_the_real_model(cached) -> None:
    """Against the cached real model's tokenizer, which the slow conversion tests hold to the GGUF's."""
    real_model, real_tokenizer = cached
    tiny_model, tiny_tokenizer = load_tiny_model()
    assert tiny_model.config.vocab_size == real_model.config.vocab_size == len(real_tokenizer)
    assert tiny_model.generation_config.eos_token_id == real_model.generation_config.eos_token_id
    assert render_prompt(tiny_tokenizer, DIALOGUE) == render_prompt(real_tokenizer, DIALOGUE)
    expected = encode_conversation(real_tokenizer, DIALOGUE, "Rome.")
    assert encode_conversation(tiny_tokenizer, DIALOGUE, "Rome.") == expected
