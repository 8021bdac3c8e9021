"""The lean engine's decode step in C (decode_step.c): a whole single-column forward in one call.

Why: once the C kernel (blocked_linear.c) streamed the projections near the memory's speed, the rest of a
PyTorch decode step was ~60 small operations per block (norms, rotary, one-query attention, the gated
activation, residual adds, views) of a few kilobytes each, whose dispatch cost a third of a SmolLM2 step
(docs/rollout-engine.md). `decode_step.c` runs them as plain loops between the same projections, with the
arithmetic of `llama_decoder` (float32; sums in other orders, ~1e-7 relative). The prefill, whose
thousands of rows amortise PyTorch's dispatch, stays in `llama_decoder`; both read and write the same
`KVCache`.

Used for the `blocked` layout only (float32 weights on a CPU where the C code builds); other layouts
decode with `llama_decoder`.
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F
from torch import Tensor

from rlhf_core.rollout.blocked_linear import BLOCK
from rlhf_core.rollout.decode_weights import Block, DecoderWeights, Linear
from rlhf_core.rollout.kernel_library import library
from rlhf_core.rollout.llama_decoder import Capture, KVCache, Positions

POINTER, LONG = ctypes.c_void_p, ctypes.c_long


class _Linear(ctypes.Structure):
    _fields_ = [("blocks", POINTER), ("bias", POINTER), ("n_blocks", LONG)]


class _Layer(ctypes.Structure):
    _fields_ = [
        ("input_norm", POINTER), ("post_norm", POINTER),
        ("qkv", _Linear), ("o", _Linear), ("gate_up", _Linear), ("down", _Linear),
    ]  # fmt: skip


class _Model(ctypes.Structure):
    _fields_ = [
        ("hidden", LONG), ("heads", LONG), ("kv_heads", LONG), ("head_dim", LONG), ("intermediate", LONG),
        ("eps", ctypes.c_float), ("layer", ctypes.POINTER(_Layer)), ("norm", POINTER),
        ("lm_head", _Linear),
    ]  # fmt: skip


class _Rollout(ctypes.Structure):
    _fields_ = [
        ("batch", LONG), ("length", LONG), ("keys", POINTER), ("values", POINTER), ("cos", POINTER),
        ("sin", POINTER), ("key_mask", POINTER), ("capture", POINTER), ("capture_layer", LONG),
        ("normed", POINTER), ("qkv", POINTER), ("attended", POINTER), ("projected", POINTER),
        ("gate_up", POINTER), ("activated", POINTER), ("scores", POINTER),
    ]  # fmt: skip


def _pointer(tensor: Tensor | None) -> int | None:
    return tensor.data_ptr() if tensor is not None else None


def _linear(linear: Linear) -> _Linear:
    return _Linear(linear.weight.data_ptr(), _pointer(linear.bias), linear.weight.shape[0])


def _layer(block: Block) -> _Layer:
    return _Layer(
        block.input_norm.data_ptr(), block.post_norm.data_ptr(),
        _linear(block.qkv), _linear(block.o), _linear(block.gate_up), _linear(block.down),
    )  # fmt: skip


def usable(weights: DecoderWeights) -> bool:
    """Whether `weights` can decode in C: the blocked layout, which `decode_weights.choose_layout` picks only
    for float32 on a CPU where the library built."""
    return weights.layout == "blocked"


class DecodeStep:
    """One rollout's C decode step: the weights' and the cache's pointers and the workspace, set up once.

    The tensors it points into (the weights, `cache`, `positions`, `capture`) must outlive it and keep
    their storage: the engine builds one per rollout, after `sync_weights`.
    """

    def __init__(self, weights: DecoderWeights, cache: KVCache, positions: Positions, capture: Capture | None) -> None:
        self.weights = weights
        self._layers = (_Layer * len(weights.blocks))(*map(_layer, weights.blocks))
        first = weights.blocks[0]
        hidden, intermediate = weights.embedding.shape[1], first.gate_up.out_features // 2
        self._model = _Model(
            hidden, weights.num_heads, weights.num_kv_heads, weights.head_dim, intermediate, weights.eps,
            ctypes.cast(self._layers, ctypes.POINTER(_Layer)), weights.norm.data_ptr(), _linear(weights.lm_head),
        )  # fmt: skip
        batch, length = cache.keys.shape[1], cache.keys.shape[3]
        # every tensor the C side points into, kept alive here; the kernel writes float32, whatever
        # torch's default dtype (a float64 default gave it buffers of another type to write into)
        self._tensors: dict[str, Tensor | None] = {
            "cos": positions.cos.contiguous(),
            "sin": positions.sin.contiguous(),
            "key_mask": positions.key_mask.contiguous() if positions.key_mask is not None else None,
            "normed": torch.empty(batch, hidden, dtype=torch.float32),
            "qkv": torch.empty(batch, first.qkv.weight.shape[0] * BLOCK, dtype=torch.float32),
            "attended": torch.empty(batch, weights.num_heads * weights.head_dim, dtype=torch.float32),
            "projected": torch.empty(
                batch, max(first.o.weight.shape[0], first.down.weight.shape[0]) * BLOCK, dtype=torch.float32
            ),
            "gate_up": torch.empty(batch, first.gate_up.weight.shape[0] * BLOCK, dtype=torch.float32),
            "activated": torch.empty(batch, intermediate, dtype=torch.float32),
            "scores": torch.empty(weights.num_heads // weights.num_kv_heads, length, dtype=torch.float32),
        }
        self._rollout = _Rollout(
            batch=batch, length=length, keys=cache.keys.data_ptr(), values=cache.values.data_ptr(),
            capture=_pointer(capture.residual) if capture is not None else None,
            capture_layer=capture.layer if capture is not None else -1,
            **{name: _pointer(tensor) for name, tensor in self._tensors.items()},
        )  # fmt: skip

    def logits(self, tokens: Tensor, column: int) -> Tensor:
        """Float32 logits ``[B, vocab]`` after the tokens ``[B]`` at cache column `column` (written to the cache)."""
        head = self.weights.lm_head
        logits = torch.empty(tokens.shape[0], head.weight.shape[0] * BLOCK, dtype=torch.float32)
        self._run(tokens, column, len(self.weights.blocks), logits)
        return logits[:, : head.out_features]

    def lower_blocks(self, tokens: Tensor, column: int, stop: int) -> None:
        """Blocks ``0 .. stop - 1`` only, for their cache column and the capture (no logits)."""
        self._run(tokens, column, stop, None)

    def _run(self, tokens: Tensor, column: int, run_layers: int, logits: Tensor | None) -> None:
        x = F.embedding(tokens, self.weights.embedding).contiguous()
        library().decode_step(
            ctypes.byref(self._model), ctypes.byref(self._rollout), column, x.data_ptr(), run_layers,
            _pointer(logits), torch.get_num_threads(),
        )  # fmt: skip
