"""Mixed precision: bf16 autocast on CUDA when asked, plain fp32 everywhere else.

Weights, gradients and optimizer states stay fp32; autocast only runs the matmuls of the forward
pass in bf16. bf16 keeps fp32's exponent range, so unlike fp16 no loss scaling is needed. On CPU the
request is ignored on purpose: CPU bf16 is slow and the CPU path exists for tests and tiny runs.
"""

import contextlib
from contextlib import AbstractContextManager

import torch


def autocast(device: torch.device, bf16: bool) -> AbstractContextManager[object]:
    """The context to run forward passes in: bf16 autocast if `bf16` and `device` is CUDA, else a no-op."""
    if bf16 and device.type == "cuda":
        return torch.autocast(device_type="cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()
