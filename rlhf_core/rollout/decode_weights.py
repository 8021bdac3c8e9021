"""The lean rollout engine's own copy of the policy's weights, laid out for small-batch decoding on a CPU.

Why a copy: a decode step multiplies a handful of rows (the rollout batch) by every weight matrix, so it
is bound by how fast the weights stream from memory. PyTorch's default fp32 CPU matmul (MKL sgemm) reaches
only a fraction of the measured bandwidth at such shapes (docs/rollout-engine.md: about 3 GB/s on
SmolLM2's LM head and 5-7 GB/s on its blocks, against 15-25 GB/s for a plain copy). Each projection's copy
is in the layout of the kernel that multiplies it (`Layout`, chosen by `ppo.rollout.kernel`):

- `blocked` (float32 on CPU, the default): blocks of 16 output columns for the project's C kernel
  (blocked_linear.py), which streams them at close to a plain read's speed;
- `reordered`: oneDNN's blocked layout (`torch.ops.mkldnn._reorder_linear_weight`, what
  `torch.compile`'s CPU backend uses with frozen weights), 1.5-4x faster than MKL at these shapes; the
  bfloat16 engine's layout (oneDNN's bf16 kernels use AMX or avx512_bf16), and the float32 one where the C
  kernel cannot be built or `ppo.rollout.kernel: onednn` asks for it;
- `plain`: the weight as it is, for `F.linear` (CUDA, a CPU build without oneDNN, or bfloat16 on a CPU
  without native bf16, where oneDNN refuses the reorder).

The weights belong to the engine, as a serving engine's do (vLLM keeps its own copy too), and are
refreshed from the policy by `DecoderWeights.refresh` before each rollout: only the parts the optimizer
can have changed (a parameter with `requires_grad`) or whose tensors were replaced or written in place
(storage pointer or version counter moved) are rebuilt, so with the CPU default of 4 trained blocks a
refresh rebuilds 4 of SmolLM2's 30 blocks (and copies the final norm), not the embedding-sized LM head.

fp32 weights give the policy's own distribution up to float32 rounding (each kernel sums in its own
order: differences of ~1e-6 relative, the same size as those between HF `generate` and the scoring pass).
bf16 weights (`ppo.rollout.dtype: bfloat16`) halve the bytes per step and use the CPU's native bf16 dot
products, but sample from a different distribution; see `lean_engine.py` for what that means for PPO.

Llama-family models only (`supported`): RMSNorm, rotary positions, grouped-query attention, a gated MLP;
LoRA adapters (peft) are merged into the copy.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import PreTrainedModel

from rlhf_core.bf16_probe import native_bf16
from rlhf_core.config.generation import Kernel
from rlhf_core.rollout.blocked_linear import blocked_linear, pad_bias, to_blocks
from rlhf_core.rollout.huge_pages import collapse_into_huge_pages
from rlhf_core.rollout.kernel_library import library

SUPPORTED_MODEL_TYPES = ("llama",)
VersionKey = tuple[tuple[int, int], ...]
Layout = Literal["blocked", "reordered", "plain"]

log = logging.getLogger(__name__)


def supported(model: PreTrainedModel) -> str | None:
    """Why the lean engine cannot run `model` (None when it can)."""
    config = model.config
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        return f"model type {config.model_type!r} (the lean engine runs {', '.join(SUPPORTED_MODEL_TYPES)})"
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        return f"rope type {rope['rope_type']!r} (only the default rotary embedding)"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r} (only silu)"
    return None


def can_reorder(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether oneDNN's reordered-weight linear is available for `device` and `dtype` (CPU builds with
    mkldnn; for bfloat16, a CPU with native bf16, without which oneDNN refuses the reorder)."""
    return (
        device.type == "cpu"
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and (dtype != torch.bfloat16 or native_bf16())
    )


def choose_layout(device: torch.device, dtype: torch.dtype, kernel: Kernel) -> Layout:
    """The projections' layout (module doc) for `ppo.rollout.kernel` = `kernel` ("blocked" or "onednn")."""
    if kernel == "blocked" and device.type == "cpu" and dtype == torch.float32 and library() is not None:
        return "blocked"
    if can_reorder(device, dtype):
        return "reordered"
    if device.type == "cpu" and dtype == torch.bfloat16:
        log.warning(
            "ppo.rollout.dtype=bfloat16 on a CPU without native bf16 (avx512_bf16, AMX): torch emulates it, "
            "far slower than float32 (docs/rollout-engine.md); use ppo.rollout.dtype=float32 here"
        )
    return "plain"


def effective_linear(module: nn.Module) -> tuple[Tensor, Tensor | None]:
    """The (weight, bias) a Linear layer applies: with peft LoRA adapters, W + sum of (alpha / r) B A."""
    base = getattr(module, "base_layer", None)
    if base is None:
        return module.weight, module.bias
    weight = base.weight
    if not getattr(module, "disable_adapters", False) and not getattr(module, "merged", False):
        for adapter in module.active_adapters:
            if adapter in module.lora_A:
                weight = weight + module.get_delta_weight(adapter)
    return weight, base.bias


def version_key(tensors: Iterable[Tensor]) -> VersionKey:
    """Where each tensor's data lives and how often it was written in place: changes when it is updated."""
    return tuple((tensor.data_ptr(), tensor._version) for tensor in tensors)


@dataclass(frozen=True)
class Linear:
    """One (possibly fused) projection, its weight in `layout` (module doc)."""

    weight: Tensor
    bias: Tensor | None
    layout: Layout
    out_features: int

    @classmethod
    def build(cls, parts: list[tuple[Tensor, Tensor | None]], dtype: torch.dtype, layout: Layout, rows: int) -> Linear:
        """The projections `parts` ((weight [out, in], bias) each) stacked into one, in `dtype`; `rows` is
        the batch size oneDNN's reordered layout is tuned for (any batch works)."""
        weight = torch.cat([w.detach() for w, _ in parts]).to(dtype).contiguous()
        biases = [b for _, b in parts]
        bias = None
        if any(b is not None for b in biases):
            bias = torch.cat(
                [b.detach() if b is not None else w.new_zeros(w.shape[0]) for (w, _), b in zip(parts, biases)]
            ).to(dtype)
        out_features = weight.shape[0]
        if layout == "blocked":
            blocks = to_blocks(weight)
            return cls(weight=blocks, bias=pad_bias(bias, blocks), layout=layout, out_features=out_features)
        if layout == "reordered":
            weight = torch.ops.mkldnn._reorder_linear_weight(weight, rows)
        return cls(weight=weight, bias=bias, layout=layout, out_features=out_features)

    def span(self) -> tuple[int, int]:
        """The weight's memory, ``[start, end)`` (oneDNN's own buffer when reordered)."""
        if self.layout == "reordered":
            start = torch.ops.mkldnn.data_ptr(self.weight)
            return start, start + torch.ops.mkldnn._nbytes(self.weight)
        start = self.weight.data_ptr()
        return start, start + self.weight.untyped_storage().nbytes()

    def __call__(self, x: Tensor) -> Tensor:
        if self.layout == "blocked":
            return blocked_linear(x, self.weight, self.bias, self.out_features)
        if self.layout == "reordered":
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


@dataclass(frozen=True)
class Block:
    """One transformer block's weights: fused q|k|v and gate|up projections, the two norms' scales."""

    input_norm: Tensor
    post_norm: Tensor
    qkv: Linear
    o: Linear
    gate_up: Linear
    down: Linear

    def linears(self) -> list[Linear]:
        return [self.qkv, self.o, self.gate_up, self.down]


def _block_sources(block: nn.Module) -> list[Tensor]:
    """Every tensor a block's copy is made from (LoRA adapters included)."""
    return list(block.parameters())


def _build_block(block: nn.Module, dtype: torch.dtype, layout: Layout, rows: int) -> Block:
    attention, mlp = block.self_attn, block.mlp
    qkv = [effective_linear(attention.q_proj), effective_linear(attention.k_proj), effective_linear(attention.v_proj)]
    return Block(
        input_norm=block.input_layernorm.weight.detach().to(dtype),
        post_norm=block.post_attention_layernorm.weight.detach().to(dtype),
        qkv=Linear.build(qkv, dtype, layout, rows),
        o=Linear.build([effective_linear(attention.o_proj)], dtype, layout, rows),
        gate_up=Linear.build([effective_linear(mlp.gate_proj), effective_linear(mlp.up_proj)], dtype, layout, rows),
        down=Linear.build([effective_linear(mlp.down_proj)], dtype, layout, rows),
    )


class DecoderWeights:
    """The policy's weights in the engine's layout, plus the model constants the decoder needs."""

    def __init__(self, model: PreTrainedModel, dtype: torch.dtype, rows: int, kernel: Kernel = "blocked") -> None:
        problem = supported(model)
        if problem is not None:
            raise ValueError(
                f"the lean rollout engine cannot run this model: {problem}; set ppo.rollout.engine (PPO) or "
                "evaluation.generation.engine (evaluation) to hf"
            )
        config = model.config
        self.dtype = dtype
        self.rows = rows  # the batch size the reordered layout is tuned for (any batch works)
        self.device = next(model.parameters()).device
        self.layout = choose_layout(self.device, dtype, kernel)
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.eps = config.rms_norm_eps
        self.rotary: Callable[[Tensor, Tensor], tuple[Tensor, Tensor]] = model.model.rotary_emb
        self.blocks: list[Block] = []
        self._keys: list[VersionKey] = []
        self.refresh(model)

    def _parts(self, model: PreTrainedModel) -> list[tuple[list[Tensor], Callable[[], list[Linear]]]]:
        """Each separately rebuilt part: the tensors it is made from, and how to rebuild it (returning the
        projections it built). The final norm is a part of its own: it trains with the top blocks, the
        embedding and the (tied) LM head do not."""
        layers = list(model.model.layers)
        embedding, lm_head, norm = model.get_input_embeddings(), model.get_output_embeddings(), model.model.norm

        def block(index: int) -> Callable[[], list[Linear]]:
            def build() -> list[Linear]:
                self.blocks[index] = _build_block(layers[index], self.dtype, self.layout, self.rows)
                return self.blocks[index].linears()

            return build

        def final_norm() -> list[Linear]:
            self.norm = norm.weight.detach().to(self.dtype)
            return []

        if len(self.blocks) != len(layers):
            self.blocks = [None] * len(layers)  # type: ignore[list-item]
        return [
            ([embedding.weight, *lm_head.parameters()], lambda: self._build_head(embedding.weight, lm_head)),
            ([norm.weight], final_norm),
            *[(_block_sources(layer), block(index)) for index, layer in enumerate(layers)],
        ]

    @torch.no_grad()
    def refresh(self, model: PreTrainedModel) -> int:
        """Rebuild what may differ from `model`'s weights now (module doc); returns how many parts were rebuilt.

        On a CPU the rebuilt projections are moved onto huge pages (rlhf_core/rollout/huge_pages.py): a decode step
        streams them all, and on 4 KiB pages one core reads them at two thirds of the speed."""
        parts = self._parts(model)
        keys = [version_key(tensors) for tensors, _ in parts]
        stale = [
            index
            for index, ((tensors, _), key) in enumerate(zip(parts, keys))
            if index >= len(self._keys) or key != self._keys[index] or any(t.requires_grad for t in tensors)
        ]
        rebuilt = [linear for index in stale for linear in parts[index][1]()]
        if self.device.type == "cpu":
            collapse_into_huge_pages(linear.span() for linear in rebuilt)
        self._keys = keys
        return len(stale)

    def _build_head(self, embedding: Tensor, lm_head: nn.Module) -> list[Linear]:
        embedding = embedding.detach()
        self.embedding = embedding if embedding.dtype == self.dtype else embedding.to(self.dtype)
        self.lm_head = Linear.build([(lm_head.weight, lm_head.bias)], self.dtype, self.layout, self.rows)
        return [self.lm_head]
