"""How fast generation could be on this machine, and how close a run came: the generation bounds.

A decode step of a batch of B replies multiplies B rows by every weight matrix once, so it cannot be
faster than the time to stream all the weights from memory (`bandwidth bound`), nor than the time to do
its ``2 x matmul parameters x B`` FLOPs at the machine's matmul rate (`compute bound`). For SmolLM2-135M
in fp32 the weights are ~0.54 GB (the tied embedding is read once, as the LM head) and a token ~0.27
GFLOP, so at small B the memory bound is the binding one. The prefill of the B x P prompt tokens is
compute-bound. A rollout's bound is the prefill's plus T - 1 decode steps' (the last sampled token is
never fed back), sampling excluded.

Measured here, on the benchmark's own thread count:
- memory bandwidth: the faster of copying and summing a 128 MiB float32 tensor (far larger than the
  last-level cache), best of several repeats, in GB/s of bytes moved (a copy counts its read and its write);
- matmul rate: a 1024 x 1024 x 1024 matmul in the generation dtype, best of several repeats, GFLOP/s.

Needs only torch (`trl_ppo_throughput.py`'s environment can import it too).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

BANDWIDTH_MIB = 128
REPEATS = 10

# The matmul whose rate bounds compute: rlhf_core.bf16_probe.matmul_gflops(dtype, SQUARE, threads).
SQUARE = ((1024, 1024, 1024),)


def _best_seconds(function: Callable[[], object], repeats: int = REPEATS) -> float:
    function()  # warm-up: page faults, kernel selection
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        function()
        best = min(best, time.perf_counter() - started)
    return best


def memory_bandwidth_gbs(mib: int = BANDWIDTH_MIB) -> float:
    """GB/s of the faster of a large copy (read + write bytes) and a large sum (read bytes)."""
    source = torch.ones(mib * 2**20 // 4)
    target = torch.empty_like(source)
    size = source.numel() * source.element_size()
    copy = 2 * size / _best_seconds(lambda: target.copy_(source))
    read = size / _best_seconds(lambda: source.sum())
    return max(copy, read) / 1e9


def matmul_parameters(model: nn.Module) -> int:
    """Parameters a decode step multiplies by: all but the input embedding (looked up, not multiplied),
    the LM head included even when it is the (tied) embedding."""
    embedding = model.get_input_embeddings().weight
    output = model.get_output_embeddings().weight
    total = sum(p.numel() for p in model.parameters())
    return total - embedding.numel() + (output.numel() if output is embedding else 0)


@dataclass(frozen=True)
class GenerationBound:
    """The lower bounds of one rollout (module doc) and the machine figures they come from."""

    memory_bandwidth_gbs: float
    matmul_gflops: float
    weight_bytes: float  # streamed per decode step
    flops_per_token: float
    decode_step_s: float  # max(bandwidth bound, compute bound) of one step of the batch
    decode_step_bandwidth_s: float
    decode_step_compute_s: float
    prefill_s: float
    generate_s: float  # prefill + (T - 1) decode steps
    tokens_per_s: float  # B / decode_step_s: the decode rate the bound allows


def generation_bound(
    model: nn.Module, dtype: torch.dtype, batch: int, prompt_length: int, response_length: int,
    bandwidth_gbs: float, gflops: float,
) -> GenerationBound:  # fmt: skip
    """The bounds of generating `response_length` tokens for `batch` prompts of `prompt_length` tokens."""
    parameters = matmul_parameters(model)
    element = torch.empty(0, dtype=dtype).element_size()
    weight_bytes = float(parameters * element)
    flops_per_token = 2.0 * parameters
    bandwidth_s = weight_bytes / (bandwidth_gbs * 1e9)
    compute_s = flops_per_token * batch / (gflops * 1e9)
    step_s = max(bandwidth_s, compute_s)
    head = model.get_output_embeddings().weight.numel()
    prefill_flops = 2.0 * (parameters - head) * batch * prompt_length + 2.0 * head * batch
    prefill_s = max(prefill_flops / (gflops * 1e9), bandwidth_s)
    return GenerationBound(
        memory_bandwidth_gbs=bandwidth_gbs,
        matmul_gflops=gflops,
        weight_bytes=weight_bytes,
        flops_per_token=flops_per_token,
        decode_step_s=step_s,
        decode_step_bandwidth_s=bandwidth_s,
        decode_step_compute_s=compute_s,
        prefill_s=prefill_s,
        generate_s=prefill_s + (response_length - 1) * step_s,
        tokens_per_s=batch / step_s,
    )


def bound_report(bound: GenerationBound, generate_s: float, tokens: int) -> dict[str, Any]:
    """The bound beside what a run measured: seconds per rollout of `tokens` generated tokens, tokens/s."""
    return {
        **asdict(bound),
        "measured_generate_s": generate_s,
        "measured_tokens_per_s": tokens / generate_s,
        "bound_generate_tokens_per_s": tokens / bound.generate_s,  # prefill included, as in the measured rate
        "bound_over_measured": bound.generate_s / generate_s,
    }


def batch_sweep(
    generate: Callable[[int], float], batch_sizes: list[int], bound: Callable[[int], GenerationBound], length: int
) -> list[dict[str, Any]]:
    """Replies per second at each rollout batch size: `generate(b)` samples b replies of `length` tokens
    and returns its wall seconds (run once first at the first size, unmeasured, as a warm-up)."""
    if batch_sizes:
        generate(batch_sizes[0])
    rows = []
    for batch in batch_sizes:
        seconds = generate(batch)
        rows.append(
            {
                "batch_size": batch,
                "replies_per_s": batch / seconds,
                **bound_report(bound(batch), seconds, batch * length),
            }
        )
    return rows


def print_generation(section: dict[str, Any]) -> None:
    """The human-readable lines of `generation_section`."""
    print(
        f"generation           engine {section['engine']} ({section['dtype']}), "
        f"{100 * section['share_of_iteration']:.1f} % of the iteration"
    )
    print(
        f"  bandwidth          {section['memory_bandwidth_gbs']:.1f} GB/s measured; matmul "
        f"{section['matmul_gflops']:.0f} GFLOP/s; {section['weight_bytes'] / 1e9:.3f} GB of weights per step"
    )
    print(
        f"  decode step bound  {1e3 * section['decode_step_s']:.1f} ms (memory "
        f"{1e3 * section['decode_step_bandwidth_s']:.1f} ms, "
        f"compute {1e3 * section['decode_step_compute_s']:.1f} ms); "
        f"prefill bound {section['prefill_s']:.2f} s"
    )
    print(
        f"  per rollout        {section['measured_generate_s']:.2f} s measured, {section['generate_s']:.2f} s bound "
        f"({100 * section['bound_over_measured']:.0f} % of the bound's speed)"
    )
    print(
        f"  tokens/s           {section['measured_tokens_per_s']:.1f} measured, "
        f"{section['bound_generate_tokens_per_s']:.1f} at the bound"
    )
    for row in section["sweep"]:
        print(
            f"  sweep batch {row['batch_size']:<4}   {row['replies_per_s']:.2f} replies/s, "
            f"{row['measured_tokens_per_s']:.1f} tokens/s "
            f"({100 * row['bound_over_measured']:.0f} % of the bound's speed)"
        )
