"""Precision: bf16 autocast only on CUDA when asked; CPU always computes in fp32."""

import pytest
import torch

from rlhf_core.training.precision import autocast


@pytest.mark.parametrize("bf16", [False, True])
def test_cpu_computes_in_fp32_even_when_bf16_is_asked(bf16: bool) -> None:
    layer = torch.nn.Linear(4, 4)
    with autocast(torch.device("cpu"), bf16):
        assert layer(torch.randn(2, 4)).dtype == torch.float32


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_bf16_autocast_runs_matmuls_in_bf16_and_keeps_fp32_weights() -> None:
    layer = torch.nn.Linear(4, 4).cuda()
    with autocast(torch.device("cuda"), True):
        assert layer(torch.randn(2, 4, device="cuda")).dtype == torch.bfloat16
    with autocast(torch.device("cuda"), False):
        assert layer(torch.randn(2, 4, device="cuda")).dtype == torch.float32
    assert layer.weight.dtype == torch.float32
