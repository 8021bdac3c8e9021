"""How fast this CPU multiplies matrices in bf16 against float32, measured once per CPU and torch version.

`distributed.bf16: auto` takes bf16 on a CPU only where it pays (training/precision.py). The flags alone do
not say so: oneDNN uses avx512_bf16 or AMX where they exist, but how much faster that is depends on the
core (about 2x with avx512_bf16, far more with AMX; docs/results/bf16-precision.md and
rollout-benchmarks.md), and a CPU without them emulates bf16 at a hundredth of float32's rate. So the probe asks
oneDNN whether the units are there, then times the matrix products the stages run most (SmolLM2's MLP at
512 and 2048 rows) in both dtypes on one thread, best of a few repeats, and keeps the answer in a JSON file
keyed by the CPU (model name and flags) and the torch version, so every stage of a run, and every later run,
makes the same choice without timing again.
"""

from __future__ import annotations

import hashlib
import json
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from rlhf_core.atomic import atomic_write_text

SHAPES = ((512, 576, 1536), (2048, 576, 1536))  # rows x inner x outer: a micro-batch through an MLP projection
REPEATS = 5
FORMAT = 1


@dataclass(frozen=True)
class MatmulRates:
    """One thread's best matrix-product rate in each dtype, and whether oneDNN has native bf16 kernels."""

    native_bf16: bool
    float32_gflops: float
    bfloat16_gflops: float

    @property
    def speedup(self) -> float:
        """bf16's rate over float32's."""
        return self.bfloat16_gflops / self.float32_gflops


def native_bf16() -> bool:
    """Whether this CPU has the instructions oneDNN's bf16 kernels need (avx512_bf16, AMX, avx_ne_convert)."""
    return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def matmul_gflops(dtype: torch.dtype, shapes: tuple[tuple[int, int, int], ...] = SHAPES, threads: int = 1) -> float:
    """The best rate over `REPEATS` of multiplying each shape in `dtype`, on `threads` threads, in GFLOP/s
    (the benchmarks time their bounds' rate with it too)."""
    generator = torch.Generator().manual_seed(0)
    threads_before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        flops, best = 0.0, 0.0
        for rows, inner, outer in shapes:
            left = torch.randn(rows, inner, generator=generator).to(dtype)
            right = torch.randn(inner, outer, generator=generator).to(dtype)
            torch.mm(left, right)  # the first call picks and builds the kernel
            fastest = min(_timed(left, right) for _ in range(REPEATS))
            flops += 2.0 * rows * inner * outer
            best += fastest
        return flops / best / 1e9
    finally:
        torch.set_num_threads(threads_before)


def _timed(left: torch.Tensor, right: torch.Tensor) -> float:
    started = time.perf_counter()
    torch.mm(left, right)
    return time.perf_counter() - started


def measure_rates() -> MatmulRates:
    """Time both dtypes now (about a second on a CPU with the units; float32 only without them)."""
    if not native_bf16():
        return MatmulRates(False, matmul_gflops(torch.float32), 0.0)
    return MatmulRates(True, matmul_gflops(torch.float32), matmul_gflops(torch.bfloat16))


def cpu_identity() -> str:
    """A key for this CPU and torch build: the CPU's model name and flags (Linux), else the platform's."""
    cpuinfo = Path("/proc/cpuinfo")
    fields = {}
    if cpuinfo.is_file():
        for line in cpuinfo.read_text(encoding="utf-8", errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("model name", "flags") and key.strip() not in fields:
                fields[key.strip()] = value.strip()
    described = json.dumps({**fields, "machine": platform.machine(), "processor": platform.processor()})
    return hashlib.sha256(f"{described} torch {torch.__version__} format {FORMAT}".encode()).hexdigest()[:16]


def cached_rates(cache_file: Path) -> MatmulRates:
    """This CPU's rates from `cache_file` (a JSON object keyed by `cpu_identity`), measured and added if absent."""
    key = cpu_identity()
    known = json.loads(cache_file.read_text(encoding="utf-8")) if cache_file.is_file() else {}
    if key in known:
        return MatmulRates(**known[key])
    rates = measure_rates()
    cache_file.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(cache_file, json.dumps({**known, key: asdict(rates)}, indent=2, sort_keys=True))
    return rates
