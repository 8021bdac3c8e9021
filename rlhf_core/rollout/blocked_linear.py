"""The lean engine's float32 CPU matrix product: a small C kernel over weights in blocks of 16 columns.

Why: a decode step multiplies the rollout batch's few rows by every weight matrix, so its speed is how
fast one core streams the weights. oneDNN's reordered-weight linear, the best of torch's kernels at these
shapes, streams SmolLM2's weights at 7-10 GB/s on one core of the machines measured, about half of what a
plain sum reads (docs/rollout-engine.md). `blocked_linear.c` lays each weight out as contiguous blocks of
16 output columns and prefetches each block's stream 4 KiB ahead; it reads the same weights at 15-16 GB/s
and runs a prefill's hundreds of rows as fast as oneDNN.

How it is built and loaded: kernel_library.py (one library with decode_step.c).

Float32 throughout: the products differ from torch's only in the order of additions (~1e-6 relative),
as oneDNN's and MKL's do from each other.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from rlhf_core.rollout.kernel_library import library

BLOCK = 16  # output columns per block, blocked_linear.c's BLOCK


def to_blocks(weight: Tensor) -> Tensor:
    """``[out, in]`` float32 -> ``[ceil(out / 16), in, 16]``: block b holds output columns 16b .. 16b + 15
    (zero rows pad the last block)."""
    out_features, in_features = weight.shape
    padded = F.pad(weight.detach().float(), (0, 0, 0, -out_features % BLOCK))
    return padded.view(-1, BLOCK, in_features).transpose(1, 2).contiguous()


def pad_bias(bias: Tensor | None, blocks: Tensor) -> Tensor | None:
    """The bias as float32, zero-padded to the blocks' width (None stays None)."""
    if bias is None:
        return None
    return F.pad(bias.detach().float(), (0, blocks.shape[0] * BLOCK - bias.shape[0]))


def blocked_linear(x: Tensor, blocks: Tensor, bias: Tensor | None, out_features: int) -> Tensor:
    """``x @ W.T + bias`` for ``x`` ``[..., in]`` float32 on CPU and `blocks` = ``to_blocks(W)``."""
    kernel = library()
    assert kernel is not None, "blocked_linear needs library(): check it before laying weights out in blocks"
    x = x.contiguous()
    rows, in_features = x.numel() // x.shape[-1], x.shape[-1]
    out = x.new_empty(*x.shape[:-1], blocks.shape[0] * BLOCK)
    kernel.blocked_linear(
        x.data_ptr(), rows, in_features, blocks.data_ptr(), blocks.shape[0],
        bias.data_ptr() if bias is not None else None, out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return out if out.shape[-1] == out_features else out[..., :out_features]
