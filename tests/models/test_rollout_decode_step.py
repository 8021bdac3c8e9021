"""The lean engine's C decode step (rlhf_core/rollout/decode_step.py) against the PyTorch decoder it replaces
(llama_decoder.py): the same logits, cache columns and captured residuals, to float32 rounding."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from transformers import PreTrainedTokenizerBase

from rlhf_core.config.model import TinyModelConfig
from rlhf_core.models.chat import encode_prompt
from rlhf_core.models.tiny import build_tiny_model
from rlhf_core.rollout.decode_step import DecodeStep, usable
from rlhf_core.rollout.decode_weights import DecoderWeights
from rlhf_core.rollout.generation import left_pad
from rlhf_core.rollout.llama_decoder import Capture, KVCache, Positions, next_token_logits, run_blocks

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc")) is None, reason="needs a C compiler"),
]

SIZES = {
    "default": TinyModelConfig(),
    # widths that are not multiples of the kernel's 16 columns, an odd half head, one kv head for 4 queries
    "odd": TinyModelConfig(num_layers=3, hidden_size=40, num_heads=4, num_kv_heads=1, intermediate_size=72),
}
STEPS = 4
TOLERANCE = 1e-5  # float32 sums in another order, through 2-3 blocks


def prepared(
    weights: DecoderWeights, prompt: tuple[torch.Tensor, torch.Tensor], layer: int
) -> tuple[KVCache, Positions, Capture, torch.Tensor]:
    """A cache, positions and a capture after PyTorch's prefill of `prompt`."""
    ids, mask = prompt
    cache = KVCache.allocate(weights, ids.shape[0], ids.shape[1] + STEPS)
    positions = Positions.for_rollout(weights, mask, STEPS)
    capture = Capture(layer, torch.zeros(ids.shape[0], ids.shape[1] + STEPS, weights.embedding.shape[1]))
    logits = next_token_logits(weights, ids, cache, 0, positions, capture)
    return cache, positions, capture, logits


@pytest.mark.parametrize("sizes", SIZES.values(), ids=SIZES.keys())
@pytest.mark.parametrize("layer", [1, 2])
def test_the_c_step_computes_what_the_pytorch_decoder_does(
    tokenizer: PreTrainedTokenizerBase, sizes: TinyModelConfig, layer: int
) -> None:
    model = build_tiny_model(tokenizer, seed=5, sizes=sizes)
    weights = DecoderWeights(model, torch.float32, rows=3)
    assert usable(weights)
    texts = ("Hi", "Count to three, slowly.", "What is the capital of France?")  # left padding on two rows
    messages = [[{"role": "user", "content": text}] for text in texts]
    prompt = left_pad([encode_prompt(tokenizer, m) for m in messages], tokenizer.pad_token_id)
    width = prompt[0].shape[1]
    reference = prepared(weights, prompt, layer)
    fused = prepared(weights, prompt, layer)
    step = DecodeStep(weights, *fused[:3])
    generator = torch.Generator().manual_seed(0)
    for column in range(width, width + STEPS - 1):
        tokens = torch.randint(0, len(tokenizer), (3,), generator=generator)
        expected = next_token_logits(weights, tokens[:, None], reference[0], column, reference[1], reference[2])
        got = step.logits(tokens, column)
        assert got.shape == expected.shape
        torch.testing.assert_close(got, expected, rtol=TOLERANCE, atol=TOLERANCE)
    last = width + STEPS - 1
    run_blocks(weights, tokens[:, None], reference[0], last, reference[1], reference[2], stop=layer)
    step.lower_blocks(tokens, last, stop=layer)
    for fused_part, reference_part in ((fused[0].keys, reference[0].keys), (fused[0].values, reference[0].values)):
        torch.testing.assert_close(fused_part[:layer], reference_part[:layer], rtol=TOLERANCE, atol=TOLERANCE)
        torch.testing.assert_close(fused_part[layer:, :, :, :last], reference_part[layer:, :, :, :last])
    torch.testing.assert_close(fused[2].residual, reference[2].residual, rtol=TOLERANCE, atol=TOLERANCE)
    assert fused[2].residual[:, last].abs().sum() > 0  # the last column's capture was written


def test_only_the_blocked_layout_decodes_in_c(tokenizer: PreTrainedTokenizerBase) -> None:
    model = build_tiny_model(tokenizer, seed=5)
    assert not usable(DecoderWeights(model, torch.float32, rows=2, kernel="onednn"))


def test_the_c_step_writes_float32_buffers_whatever_the_default_dtype(tokenizer: PreTrainedTokenizerBase) -> None:
    """Its workspace and logits are float32 also under a float64 default (the PPO reference tests' setting):
    buffers of the default dtype let the kernel write float32 into float64 memory (garbage, at times NaN)."""
    model = build_tiny_model(tokenizer, seed=5)
    weights = DecoderWeights(model, torch.float32, rows=1)
    prompt = left_pad([encode_prompt(tokenizer, [{"role": "user", "content": "Hi"}])], tokenizer.pad_token_id)
    width = prompt[0].shape[1]
    reference = prepared(weights, prompt, 1)
    fused = prepared(weights, prompt, 1)
    tokens = torch.tensor([7])
    expected = next_token_logits(weights, tokens[:, None], reference[0], width, reference[1], reference[2])
    torch.set_default_dtype(torch.float64)
    try:
        got = DecodeStep(weights, *fused[:3]).logits(tokens, width)
    finally:
        torch.set_default_dtype(torch.float32)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=TOLERANCE, atol=TOLERANCE)
