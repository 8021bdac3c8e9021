"""A Llama forward pass for sampling only: a preallocated KV cache, no masks or caches rebuilt per step.

Hugging Face `generate` spends a decode step's time on more than the model: a `DynamicCache` that grows
every layer's keys and values with `torch.cat` (12% of a SmolLM2 decode step in a profile), a 4-D mask
rebuilt from the 2-D attention mask, position ids and rotary tables recomputed, logits processors and
stopping criteria consulted. Here a rollout allocates its whole cache once (`KVCache`, ``[layers, B,
kv_heads, P + T, head_dim]``), computes every position's rotary table once (`Positions`), and each step
writes one column of the cache and attends over its filled prefix.

The arithmetic is the Hugging Face Llama forward's (`transformers.models.llama.modeling_llama`): RMSNorm in
float32, rotary embeddings from the model's own `rotary_emb`, grouped-query SDPA attention with the
model's scaling, a SiLU-gated MLP, the final norm and the LM head on the last position only. Positions
count real tokens only (left padding does not shift them), exactly as `generate` and the scoring passes
count them. Left-padding columns are masked out as keys; a padding query attends to itself alone, so its
(never read) output stays finite instead of NaN.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from rlhf_core.models.blocks import positions_from_mask
from rlhf_core.rollout.decode_weights import Block, DecoderWeights


@dataclass
class KVCache:
    """Keys and values of every layer for a whole rollout, ``[layers, B, kv_heads, P + T, head_dim]``."""

    keys: Tensor
    values: Tensor

    @classmethod
    def allocate(cls, weights: DecoderWeights, batch: int, length: int) -> KVCache:
        shape = (len(weights.blocks), batch, weights.num_kv_heads, length, weights.head_dim)
        device = weights.embedding.device
        return cls(
            keys=torch.empty(shape, dtype=weights.dtype, device=device),
            values=torch.empty(shape, dtype=weights.dtype, device=device),
        )


@dataclass(frozen=True)
class Positions:
    """Rotary tables and key masks for every column of a rollout (prompt ``P`` + up to ``T`` replies)."""

    cos: Tensor  # [B, P + T, head_dim]
    sin: Tensor
    key_mask: Tensor | None  # [B, P + T] bool: False on left padding; None when no prompt is padded
    prompt_width: int

    @classmethod
    def for_rollout(cls, weights: DecoderWeights, prompt_mask: Tensor, max_new_tokens: int) -> Positions:
        """Prompt positions over real tokens, then one more per generated token (as `generate` counts)."""
        real = prompt_mask.bool()
        prompt_positions = positions_from_mask(prompt_mask)
        steps = torch.arange(max_new_tokens, device=prompt_mask.device)
        reply_positions = real.sum(dim=1, keepdim=True) + steps
        positions = torch.cat([prompt_positions, reply_positions], dim=1)
        probe = torch.empty(0, dtype=weights.dtype, device=prompt_mask.device)
        cos, sin = weights.rotary(probe, positions)
        key_mask = None
        if not bool(real.all()):
            key_mask = torch.cat([real, real.new_ones(real.shape[0], max_new_tokens)], dim=1)
        return cls(cos=cos, sin=sin, key_mask=key_mask, prompt_width=prompt_mask.shape[1])


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """`LlamaRMSNorm`: normalise in float32, scale in the input's dtype."""
    dtype = x.dtype
    hidden = x.float()
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
    return weight * hidden.to(dtype)


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """`apply_rotary_pos_emb` for one tensor ``[B, heads, S, head_dim]``; cos/sin ``[B, S, head_dim]``."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)


def _prefill_mask(key_mask: Tensor | None, width: int) -> Tensor | None:
    """``[B, 1, P, P]`` causal mask over real keys (a padding query sees itself); None without padding."""
    if key_mask is None:
        return None
    causal = torch.ones(width, width, dtype=torch.bool, device=key_mask.device).tril()
    own = torch.eye(width, dtype=torch.bool, device=key_mask.device)
    return (causal & key_mask[:, None, None, :width]) | own


def attend(weights: DecoderWeights, query: Tensor, keys: Tensor, values: Tensor, mask: Tensor | None) -> Tensor:
    """SDPA over the cached prefix; returns ``[B, S, heads * head_dim]``.

    One query (a decode step) is regrouped to ``[B, kv_heads, group, head_dim]`` so that no key is
    repeated (what transformers' SDPA path does for one query); a prefill repeats keys per group when
    masked, else uses SDPA's causal, grouped kernel.
    """
    batch, heads, length, dim = query.shape
    group = heads // weights.num_kv_heads
    scale = dim**-0.5
    if length == 1:
        grouped = query.reshape(batch, weights.num_kv_heads, group, dim)
        out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask, scale=scale)
        return out.reshape(batch, 1, heads * dim)
    if mask is None:
        out = F.scaled_dot_product_attention(query, keys, values, is_causal=True, scale=scale, enable_gqa=group > 1)
    else:
        keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scale)
    return out.transpose(1, 2).reshape(batch, length, heads * dim)


def _block(
    weights: DecoderWeights, block: Block, index: int, x: Tensor, cache: KVCache, start: int, positions: Positions
) -> Tensor:
    """One transformer block on the new columns ``x`` ``[B, S, hidden]`` starting at cache column `start`."""
    batch, length, _ = x.shape
    heads, kv_heads, dim = weights.num_heads, weights.num_kv_heads, weights.head_dim
    stop = start + length
    qkv = block.qkv(rms_norm(x, block.input_norm, weights.eps))
    query, key, value = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    cos, sin = positions.cos[:, start:stop], positions.sin[:, start:stop]
    query = rotate(query.view(batch, length, heads, dim).transpose(1, 2), cos, sin)
    cache.keys[index, :, :, start:stop] = rotate(key.view(batch, length, kv_heads, dim).transpose(1, 2), cos, sin)
    cache.values[index, :, :, start:stop] = value.view(batch, length, kv_heads, dim).transpose(1, 2)
    if length > 1:
        mask = _prefill_mask(positions.key_mask, length)
    else:
        mask = positions.key_mask[:, None, None, :stop] if positions.key_mask is not None else None
    attended = attend(weights, query, cache.keys[index, :, :, :stop], cache.values[index, :, :, :stop], mask)
    x = x + block.o(attended)
    gate, up = block.gate_up(rms_norm(x, block.post_norm, weights.eps)).chunk(2, dim=-1)
    return x + block.down(F.silu(gate) * up)


@dataclass(frozen=True)
class Capture:
    """Where to keep the residual stream entering block `layer` of every column: ``[B, P + T, hidden]``.

    That is what the shared trunk (rlhf_core/ppo/shared_trunk.py) computes for the scoring passes from
    the same tokens; the decoder computes it anyway on its way to the logits.
    """

    layer: int
    residual: Tensor


def run_blocks(
    weights: DecoderWeights, ids: Tensor, cache: KVCache, start: int, positions: Positions,
    capture: Capture | None = None, stop: int | None = None,
) -> Tensor:  # fmt: skip
    """The residual stream of the columns `ids` ``[B, S]`` after blocks ``0 .. stop - 1`` (all when None).

    The new columns' keys and values are written to `cache` at columns ``start .. start + S - 1``, and
    with `capture` their residual entering block `capture.layer` to `capture.residual`.
    """
    x = F.embedding(ids, weights.embedding)
    blocks = weights.blocks[:stop]
    for index, block in enumerate(blocks):
        if capture is not None and index == capture.layer:
            capture.residual[:, start : start + ids.shape[1]] = x
        x = _block(weights, block, index, x, cache, start, positions)
    if capture is not None and capture.layer == len(blocks):
        capture.residual[:, start : start + ids.shape[1]] = x
    return x


def next_token_logits(
    weights: DecoderWeights, ids: Tensor, cache: KVCache, start: int, positions: Positions,
    capture: Capture | None = None,
) -> Tensor:  # fmt: skip
    """Float32 logits ``[B, vocab]`` after the columns `ids` ``[B, S]`` (the prompt, or one new token)."""
    x = run_blocks(weights, ids, cache, start, positions, capture)
    last = rms_norm(x[:, -1], weights.norm, weights.eps)
    return weights.lm_head(last).float()


@dataclass(frozen=True)
class TorchStep:
    """One rollout's decode step through the functions above (`decode_step.DecodeStep` is its C twin)."""

    weights: DecoderWeights
    cache: KVCache
    positions: Positions
    capture: Capture | None

    def logits(self, tokens: Tensor, column: int) -> Tensor:
        """Float32 logits ``[B, vocab]`` after the tokens ``[B]`` at cache column `column`."""
        return next_token_logits(self.weights, tokens[:, None], self.cache, column, self.positions, self.capture)

    def lower_blocks(self, tokens: Tensor, column: int, stop: int) -> None:
        """Blocks ``0 .. stop - 1`` only, for their cache column and the capture (no logits)."""
        run_blocks(self.weights, tokens[:, None], self.cache, column, self.positions, self.capture, stop=stop)
