"""The lean engine's C code (blocked_linear.c, decode_step.c), built on first use and loaded with ctypes.

How it is built: with the system's C compiler (`$CC`, else `cc`) and `-O3 -march=native -fopenmp`, into
one shared library in a per-user cache (`$XDG_CACHE_HOME/rlhf-pipeline/kernels`, else ~/.cache/...). The
file name carries a hash of the sources, the flags, the compiler and the CPU's feature flags, so a changed
kernel, compiler or machine (a home directory shared across a cluster) never loads a library built for
another; it is written under a temporary name and renamed, so concurrent ranks never load a half-written
one. Where it cannot be built (no compiler, a compiler without OpenMP or GCC vector extensions)
`library()` is None and the engine uses oneDNN and PyTorch's operations instead (decode_weights.py), with
one warning. The OpenMP runtime is the one torch already loaded (`libgomp.so.1` by soname), so the
kernels share torch's threads and follow `torch.get_num_threads()`.
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

log = logging.getLogger(__name__)

SOURCES = (Path(__file__).with_name("blocked_linear.c"), Path(__file__).with_name("decode_step.c"))
# -Werror=vector-operation-performance: GCC splits a vector type wider than the CPU's registers into
# pieces through the stack, 16x slower than oneDNN (blocked_linear.c); such a build fails, and the engine
# falls back to oneDNN, rather than load a kernel that slow.
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-Werror=vector-operation-performance")
COMPILE_TIMEOUT_S = 120
POINTER, LONG, INT = ctypes.c_void_p, ctypes.c_long, ctypes.c_int
SIGNATURES = {  # the entry points' argument types (the C files document them)
    "blocked_linear": [POINTER, LONG, LONG, POINTER, LONG, POINTER, POINTER, INT],
    "decode_step": [POINTER, POINTER, LONG, POINTER, LONG, POINTER, INT],
}


def cache_directory() -> Path:
    """Where built libraries are kept: ``$XDG_CACHE_HOME/rlhf-pipeline/kernels`` (default ``~/.cache``)."""
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


def library_path(compiler: str, sources: list[bytes]) -> Path:
    """The built library's path for these sources' texts, the compiler, the flags and the CPU (module doc)."""
    key = hashlib.sha256()
    for part in (*sources, compiler.encode(), " ".join(FLAGS).encode(), cpu_features().encode()):
        key.update(part)
        key.update(b"\0")
    return cache_directory() / f"lean-engine-{key.hexdigest()[:24]}.so"


def build(compiler: str, sources: tuple[Path, ...], target: Path) -> None:
    """Compile `sources` into `target`, atomically (a temporary file in the same directory, then renamed)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=target.parent, prefix=".building-", suffix=".so")
    os.close(handle)
    try:
        subprocess.run(
            [compiler, *FLAGS, "-o", temporary, *map(str, sources), "-lm"],
            check=True, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S,
        )  # fmt: skip
        os.replace(temporary, target)
    finally:
        Path(temporary).unlink(missing_ok=True)


@functools.cache
def library() -> ctypes.CDLL | None:
    """The library, built on first use and loaded (module doc); None, after one warning, where it cannot be."""
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        log.warning("no C compiler ($CC or cc): the lean engine runs on oneDNN and PyTorch's operations instead")
        return None
    target = library_path(compiler, [source.read_bytes() for source in SOURCES])
    try:
        if not target.exists():
            build(compiler, SOURCES, target)
        loaded = ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as error:
        detail = getattr(error, "stderr", "") or error
        log.warning("could not build the lean engine's C code (%s): it runs on oneDNN instead", detail)
        return None
    for name, argtypes in SIGNATURES.items():
        function = getattr(loaded, name)
        function.restype, function.argtypes = None, argtypes
    return loaded
