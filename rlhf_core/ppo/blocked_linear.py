"""The lean engine's float32 CPU matrix product: a small C kernel over weights in blocks of 16 columns.

Why: a decode step multiplies the rollout batch's few rows by every weight matrix, so its speed is how
fast one core streams the weights. oneDNN's reordered-weight linear, the best of torch's kernels at these
shapes, streams SmolLM2's weights at 7-10 GB/s on one core of the machines measured, about half of what a
plain sum reads (docs/rollout-engine.md). `blocked_linear.c` lays each weight out as contiguous blocks of
16 output columns and prefetches each block's stream 4 KiB ahead; it reads the same weights at 15-16 GB/s
and runs a prefill's hundreds of rows as fast as oneDNN.

How it is built: on first use, with the system's C compiler (`$CC`, else `cc`) and `-O3 -march=native
-fopenmp`, into a per-user cache (`$XDG_CACHE_HOME/rlhf-pipeline/kernels`, else ~/.cache/...). The file
name carries a hash of the source, the flags, the compiler and the CPU's feature flags, so a changed
kernel, compiler or machine (a home directory shared across a cluster) never loads a library built for
another; it is written under a temporary name and renamed, so concurrent ranks never load a half-written
one. Where it cannot be built (no compiler, a compiler without OpenMP or GCC vector extensions)
`library()` is None and the engine uses oneDNN (`decode_weights.Linear`), with one warning. The OpenMP
runtime is the one torch already loaded (`libgomp.so.1` by soname), so the kernel shares torch's threads
and follows `torch.get_num_threads()`.

Float32 throughout: the products differ from torch's only in the order of additions (~1e-6 relative),
as oneDNN's and MKL's do from each other.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("blocked_linear.c")
BLOCK = 16  # output columns per block, blocked_linear.c's BLOCK
# -Werror=vector-operation-performance: GCC splits a vector type wider than the CPU's registers into
# pieces through the stack, 16x slower than oneDNN (blocked_linear.c); such a build fails, and the engine
# falls back to oneDNN, rather than load a kernel that slow.
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-Werror=vector-operation-performance")
COMPILE_TIMEOUT_S = 120


def cache_directory() -> Path:
    """Where built kernels are kept: ``$XDG_CACHE_HOME/rlhf-pipeline/kernels`` (default ``~/.cache``)."""
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "rlhf-pipeline" / "kernels"


def cpu_features() -> str:
    """The CPU's feature flags (what -march=native compiles for), or the architecture's name off Linux."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def library_path(compiler: str, source: bytes) -> Path:
    """The built library's path for this source, compiler, flags and CPU (module doc)."""
    key = hashlib.sha256()
    for part in (source, compiler.encode(), " ".join(FLAGS).encode(), cpu_features().encode()):
        key.update(part)
        key.update(b"\0")
    return cache_directory() / f"blocked_linear-{key.hexdigest()[:24]}.so"


def build(compiler: str, source: Path, target: Path) -> None:
    """Compile `source` into `target`, atomically (a temporary file in the same directory, then renamed)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=target.parent, prefix=".building-", suffix=".so")
    os.close(handle)
    try:
        subprocess.run(
            [compiler, *FLAGS, "-o", temporary, str(source)],
            check=True, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S,
        )  # fmt: skip
        os.replace(temporary, target)
    finally:
        Path(temporary).unlink(missing_ok=True)


@functools.cache
def library() -> ctypes.CDLL | None:
    """The kernel, built on first use and loaded (module doc); None, after one warning, where it cannot be."""
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        log.warning("no C compiler ($CC or cc): the lean engine multiplies with oneDNN instead")
        return None
    target = library_path(compiler, SOURCE.read_bytes())
    try:
        if not target.exists():
            build(compiler, SOURCE, target)
        loaded = ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as error:
        detail = getattr(error, "stderr", "") or error
        log.warning("could not build %s (%s): the lean engine multiplies with oneDNN instead", SOURCE.name, detail)
        return None
    loaded.blocked_linear.restype = None
    loaded.blocked_linear.argtypes = [
        ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_void_p,
        ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
    ]  # fmt: skip
    return loaded


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
