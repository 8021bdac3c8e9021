"""FLOPs of the passes a pipeline stage makes, from the model's shape alone: what `stage_bounds.py` adds up.

The unit is one pass of a padded batch (`rows` sequences padded to `width` tokens) through some of a
decoder's blocks. A block's matmuls cost 2 FLOPs per parameter per token (q, k, v, o, gate, up, down);
its attention 4 x heads x head_dim FLOPs per query per key (scores and the weighted sum), over every
padded key, as a masked SDPA computes them. The LM head costs 2 x vocab x hidden per position it is
applied at: the stages apply it only where they need logits (reply targets, the response, the last
prompt token). A backward pass through trained blocks costs twice their forward (the gradient of the
activations and of the weights); the frozen head tied to the embedding passes back only the gradient of
its input (as much as its forward). Norms, rotary, softmax, the optimizer and the scalar heads are left
out (under 1% of these at SmolLM2's shape). Nothing here imports torch: tests check it by hand.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields

FLOAT32_BYTES = 4


@dataclass(frozen=True)
class ModelShape:
    """A Llama-family decoder's sizes, as its Hugging Face `config.json` names them."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int

    @classmethod
    def from_config(cls, config: Mapping[str, object]) -> ModelShape:
        """The shape of a `config.json` (LlamaConfig keys; kv heads default to the heads)."""
        heads = int(config["num_attention_heads"])
        return cls(
            hidden=int(config["hidden_size"]),
            intermediate=int(config["intermediate_size"]),
            layers=int(config["num_hidden_layers"]),
            heads=heads,
            kv_heads=int(config.get("num_key_value_heads") or heads),
            vocab=int(config["vocab_size"]),
        )

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def block_parameters(self) -> int:
        """Matmul parameters of one block: q and o (hidden^2 each), k and v (hidden x kv width), the MLP."""
        attention = 2 * self.hidden * self.heads * self.head_dim + 2 * self.hidden * self.kv_heads * self.head_dim
        return attention + 3 * self.hidden * self.intermediate

    @property
    def head_parameters(self) -> int:
        """The LM head's (tied or not, it is multiplied once per position it is applied at)."""
        return self.vocab * self.hidden

    @property
    def matmul_parameters(self) -> int:
        """Every block and the LM head: what a decode step multiplies each row by."""
        return self.layers * self.block_parameters + self.head_parameters

    @property
    def weight_bytes(self) -> int:
        """Bytes a float32 decode step streams from memory (each matmul weight once)."""
        return FLOAT32_BYTES * self.matmul_parameters


@dataclass(frozen=True)
class Work:
    """What a stage (or a part of it) computes: tokens through the model, FLOPs, and its decode steps.

    `decode_steps` and `decode_flops` (included in `flops`) are the single-column generation steps: each
    streams every weight once, so its bound is the slower of its FLOPs and that stream (`bound_seconds`).
    """

    real_tokens: int = 0
    padded_tokens: int = 0
    flops: float = 0.0
    decode_steps: int = 0
    decode_flops: float = 0.0

    def __add__(self, other: Work) -> Work:
        return Work(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    def bound_seconds(self, gflops: float, bandwidth_gbs: float, weight_bytes: int) -> float:
        """Compute-bound seconds of the batched passes plus each decode step's max(compute, weight stream)."""
        batched = (self.flops - self.decode_flops) / (gflops * 1e9)
        if not self.decode_steps:
            return batched
        step = max(self.decode_flops / self.decode_steps / (gflops * 1e9), weight_bytes / (bandwidth_gbs * 1e9))
        return batched + self.decode_steps * step


def total(works: Sequence[Work]) -> Work:
    """The sum of `works`."""
    summed = Work()
    for work in works:
        summed = summed + work
    return summed


def forward_flops(shape: ModelShape, rows: int, width: int, blocks: int) -> float:
    """FLOPs of `blocks` blocks over `rows` sequences padded to `width` tokens."""
    matmuls = 2.0 * shape.block_parameters * rows * width
    attention = 4.0 * shape.heads * shape.head_dim * rows * width * width
    return blocks * (matmuls + attention)


def head_flops(shape: ModelShape, positions: int, backward: bool = False) -> float:
    """The LM head at `positions` positions; with `backward`, also its input's gradient (the head is frozen)."""
    return 2.0 * shape.head_parameters * positions * (2 if backward else 1)


def batch_pass(
    shape: ModelShape,
    lengths: Sequence[int],
    blocks: int,
    head_positions: int = 0,
    trained_blocks: int = 0,
    width: int | None = None,
) -> Work:
    """One padded batch of sequences of `lengths` (padded to `width`, default their longest) through the
    top `blocks` blocks, the LM head at `head_positions`; with `trained_blocks`, the backward pass through
    that many top blocks and, when the head was applied, the head's input gradient."""
    width = max(lengths) if width is None else width
    rows = len(lengths)
    flops = forward_flops(shape, rows, width, blocks) + head_flops(shape, head_positions, backward=trained_blocks > 0)
    flops += 2.0 * forward_flops(shape, rows, width, trained_blocks)
    return Work(real_tokens=sum(lengths), padded_tokens=rows * width, flops=flops)


def cached_lower_pass(shape: ModelShape, lengths: Sequence[int], blocks: int) -> Work:
    """The frozen lower `blocks` blocks over each sequence alone, unpadded (a frozen-layer cache's fill)."""
    flops = sum(forward_flops(shape, 1, length, blocks) for length in lengths)
    return Work(real_tokens=sum(lengths), padded_tokens=sum(lengths), flops=flops)


def generation(shape: ModelShape, rows: int, prompt_width: int, steps: int, real_tokens: int) -> Work:
    """A KV-cached rollout: the prefill of `rows` prompts padded to `prompt_width` (head at the last column),
    then `steps - 1` decode steps of one column each over the growing cache (the last token is not fed
    back). `real_tokens`: the prompts' and replies' tokens without padding."""
    prefill = forward_flops(shape, rows, prompt_width, shape.layers) + head_flops(shape, rows)
    decode = 0.0
    for step in range(1, steps):
        context = prompt_width + step
        decode += 2.0 * shape.matmul_parameters * rows
        decode += shape.layers * 4.0 * shape.heads * shape.head_dim * rows * context
    return Work(
        real_tokens=real_tokens,
        padded_tokens=rows * (prompt_width + steps),
        flops=prefill + decode,
        decode_steps=max(steps - 1, 0),
        decode_flops=decode,
    )
