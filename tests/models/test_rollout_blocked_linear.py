"""The lean engine's C kernel (rlhf_core/rollout/blocked_linear.py): its products against plain float64 ones,
its weight layout, how the C library is built and cached (kernel_library.py), and the engine's fallback to
oneDNN without a compiler."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import Tensor
from transformers import PreTrainedTokenizerBase

from rlhf_core.config import RolloutConfig
from rlhf_core.models.chat import encode_prompt
from rlhf_core.models.tiny import build_tiny_model
from rlhf_core.rollout import blocked_linear as kernel
from rlhf_core.rollout import kernel_library
from rlhf_core.rollout.decode_weights import choose_layout
from rlhf_core.rollout.engine import SamplingParams
from rlhf_core.rollout.generation import left_pad, stop_token_ids
from rlhf_core.rollout.lean_engine import LeanEngine

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc")) is None, reason="needs a C compiler")

SHAPES = [  # (leading dims of x, in_features, out_features): tails of row tiles and of blocks, odd block counts
    ((1,), 64, 16),
    ((3,), 5, 40),
    ((8,), 64, 96),
    ((9,), 48, 32),  # one row more than AVX2's single tile: tiles of 6 and 3
    ((12,), 64, 32),  # AVX-512's single tile; two AVX2 tiles of 6
    ((2, 13), 37, 100),
    ((70,), 256, 112),  # enough work that two threads split it
    ((200,), 1536, 48),  # more rows than one chunk (84 at this width): three chunks, the last a partial one
]


def reference(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """x W^T + b, written out in float64."""
    out = x.double() @ weight.double().T
    return out + bias.double() if bias is not None else out


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_products_equal_plain_float64_ones_to_float32_rounding(
    shape: tuple[tuple[int, ...], int, int], with_bias: bool, threads: int
) -> None:
    leading, in_features, out_features = shape
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(*leading, in_features, generator=generator)
    weight = torch.randn(out_features, in_features, generator=generator)
    bias = torch.randn(out_features, generator=generator) if with_bias else None
    blocks = kernel.to_blocks(weight)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = kernel.blocked_linear(x, blocks, kernel.pad_bias(bias, blocks), out_features)
    finally:
        torch.set_num_threads(previous)
    expected = reference(x, weight, bias)
    assert got.shape == (*leading, out_features) and got.dtype == torch.float32
    # the classic bound on a float32 sum of k + 1 products: (k + 1) eps times the sum of their magnitudes
    magnitudes = reference(x.abs(), weight.abs(), bias.abs() if bias is not None else None)
    bound = (in_features + 1) * torch.finfo(torch.float32).eps * magnitudes
    assert ((got.double() - expected).abs() <= bound).all()


def test_blocks_hold_sixteen_output_columns_each_padded_with_zeros() -> None:
    weight = torch.arange(20 * 3, dtype=torch.float32).view(20, 3)
    blocks = kernel.to_blocks(weight)
    assert blocks.shape == (2, 3, 16) and blocks.is_contiguous()
    for column in range(20):
        assert torch.equal(blocks[column // 16, :, column % 16], weight[column])
    assert not blocks[1, :, 4:].any()
    assert torch.equal(kernel.pad_bias(torch.ones(20), blocks), torch.cat([torch.ones(20), torch.zeros(12)]))


@pytest.mark.slow
def test_the_library_is_keyed_by_its_source_and_written_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    compiler = shutil.which(os.environ.get("CC", "cc"))
    assert compiler is not None
    sources = [source.read_bytes() for source in kernel_library.SOURCES]
    target = kernel_library.library_path(compiler, sources)
    assert target.parent == tmp_path / "rlhf-pipeline" / "kernels"
    assert kernel_library.library_path(compiler, [sources[0], sources[1] + b"\n"]) != target
    kernel_library.build(compiler, kernel_library.SOURCES, target)
    assert [path.name for path in target.parent.iterdir()] == [target.name]

    broken = tmp_path / "broken.c"
    broken.write_text("this is not C\n")
    with pytest.raises(subprocess.CalledProcessError):
        kernel_library.build(compiler, (kernel_library.SOURCES[0], broken), target.with_name("broken.so"))
    assert [path.name for path in target.parent.iterdir()] == [target.name]  # nothing half-written left


X86_LEVELS = ["x86-64", "x86-64-v3", "x86-64-v4"]  # SSE2, AVX2, AVX-512: each of the kernel's vector widths


@pytest.mark.slow
@pytest.mark.skipif(os.uname().machine != "x86_64", reason="compiles for x86-64 levels")
@pytest.mark.parametrize("level", X86_LEVELS)
def test_the_kernel_uses_whole_registers_at_every_x86_level(level: str, tmp_path: Path) -> None:
    """The build's flags (without -march=native) turn GCC's 'expanded piecewise' warning, the sign of a
    vector wider than the registers, into an error; every x86 level the kernel has a tile for compiles."""
    compiler = shutil.which(os.environ.get("CC", "cc"))
    assert compiler is not None
    flags = [flag for flag in kernel_library.FLAGS if flag != "-march=native"]
    built = subprocess.run(
        [compiler, *flags, f"-march={level}", "-o", str(tmp_path / "kernel.so"), *map(str, kernel_library.SOURCES)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr
    assert "piecewise" not in built.stderr


@pytest.fixture
def no_compiler(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A process where `cc` cannot be found: the kernel's cached load is forgotten before and after."""
    monkeypatch.setenv("CC", "/nonexistent/cc")
    kernel_library.library.cache_clear()
    yield
    kernel_library.library.cache_clear()


def rollout(tokenizer: PreTrainedTokenizerBase, kernel_name: str) -> tuple[str, list[Tensor]]:
    """The tiny lean engine's layout and its replies for three seeds (multinomial draws, 8 tokens)."""
    model = build_tiny_model(tokenizer, seed=6)
    settings = RolloutConfig(max_new_tokens=8, sampler="multinomial", kernel=kernel_name)
    sampling = SamplingParams(settings, tuple(stop_token_ids(tokenizer)), tokenizer.pad_token_id)
    messages = [[{"role": "user", "content": text}] for text in ("Hi", "Count to three, slowly.")]
    prompt = left_pad([encode_prompt(tokenizer, m) for m in messages], tokenizer.pad_token_id)
    engine = LeanEngine(model, settings, rollout_batch_size=2)
    return engine.weights.layout, [engine.generate(*prompt, sampling, seed=s).response_ids for s in range(3)]


@pytest.mark.usefixtures("one_thread")
def test_the_kernels_sample_the_same_replies(tokenizer: PreTrainedTokenizerBase) -> None:
    blocked_layout, blocked = rollout(tokenizer, "blocked")
    onednn_layout, onednn = rollout(tokenizer, "onednn")
    assert (blocked_layout, onednn_layout) == ("blocked", "reordered")
    assert all(torch.equal(a, b) for a, b in zip(blocked, onednn))


@pytest.mark.usefixtures("one_thread", "no_compiler")
def test_without_a_compiler_the_engine_multiplies_with_onednn(
    tokenizer: PreTrainedTokenizerBase, caplog: pytest.LogCaptureFixture
) -> None:
    assert kernel_library.library() is None
    assert "no C compiler" in caplog.text
    assert choose_layout(torch.device("cpu"), torch.float32, "blocked") == "reordered"
    layout, _ = rollout(tokenizer, "blocked")
    assert layout == "reordered"
