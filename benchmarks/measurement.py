"""What a throughput run measures and how it turns timings into the reported figures.

Shared by `ppo_throughput.py` (this project's trainer) and `trl_ppo_throughput.py` (TRL's, run in
its own virtual environment), so both sides report the same figures computed the same way. Needs
only the standard library and torch.

Figures (all over the measured iterations, warm-up excluded):

- samples/s = rollout batch size x iterations / wall time;
- generated tokens/s = generated tokens / wall time (both sides generate exactly
  batch x response length tokens per iteration);
- samples per CPU-second = samples / the process's CPU time over the measured iterations: on a
  machine shared with other jobs, wall time depends on their load and CPU time much less, so this
  is the steadier figure for comparing two runs made at different moments;
- the time split: generation (the batched `generate` call), scoring (the no-grad forward passes
  that judge the rollout: policy / reference log-probs, critic values, reward scores), training
  (the PPO epochs: forward, backward, optimizer steps) and other (experience assembly: rewards,
  GAE, monitors, bookkeeping); the four add up to the wall time;
- peak memory: on CUDA `torch.cuda.max_memory_allocated` over the measured iterations; on CPU the
  process's resident-set high-water mark over the measured iterations (Linux `VmHWM`, reset through
  /proc/self/clear_refs when they start), and the whole process's peak RSS including model loading;
- model FLOPs (`FLOPS_FORMULA`) and, given the accelerator's peak, model FLOP utilisation.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

FLOPS_FORMULA = (
    "model FLOPs per iteration = 2*N*B*S (generation: prefill + decode) "
    "+ 4 * 2*N*B*S (scoring: policy, reference, critic and reward forward passes) "
    "+ E * 2 * 6*N*B*S (training: policy and critic, forward + backward, every PPO epoch); "
    "N = policy parameters (embeddings included), B = rollout batch, S = prompt + response length, "
    "E = PPO epochs. The same workload count for every implementation, so MFU ratios equal "
    "throughput ratios; frozen layers are counted as trained."
)
CLEAR_REFS = Path("/proc/self/clear_refs")
PROC_STATUS = Path("/proc/self/status")


@dataclass(frozen=True)
class IterationTimes:
    """Wall seconds of one PPO iteration, by phase (see the module docstring)."""

    generate_s: float
    score_s: float
    train_s: float
    other_s: float

    @property
    def total_s(self) -> float:
        return self.generate_s + self.score_s + self.train_s + self.other_s


@dataclass(frozen=True)
class Workload:
    """What one iteration processes: the numbers the throughput and FLOPs figures need."""

    batch_size: int
    prompt_length: int
    response_length: int
    ppo_epochs: int
    parameters: int


def model_flops_per_iteration(workload: Workload) -> float:
    """`FLOPS_FORMULA` for one iteration of `workload`."""
    tokens = workload.batch_size * (workload.prompt_length + workload.response_length)
    forward = 2.0 * workload.parameters * tokens
    train = 6.0 * workload.parameters * tokens
    return forward + 4 * forward + workload.ppo_epochs * 2 * train


def synchronize(device: torch.device) -> None:
    """Wait for queued CUDA kernels, so a wall-clock reading includes them (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _proc_status_bytes(field: str) -> int | None:
    """A memory field of /proc/self/status (Linux: "VmHWM", "VmRSS") in bytes, or None elsewhere."""
    if not PROC_STATUS.is_file():
        return None
    for line in PROC_STATUS.read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return None


def process_peak_rss_bytes() -> int:
    """Peak resident set of the whole process so far (model loading included)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # macOS reports bytes, Linux KiB


@dataclass(frozen=True)
class MemoryWindow:
    """A peak-memory window opened by `start_memory_window`.

    `rss_scope` is "iterations" when the kernel let us reset the RSS high-water mark (Linux: writing
    5 to /proc/self/clear_refs), else "process" (the RSS figure then includes model loading).
    """

    rss_scope: str
    rss_start_bytes: int | None  # resident set when the window opened (models loaded, warmed up)


def start_memory_window(device: torch.device) -> MemoryWindow:
    """Reset the peak-memory counters: what is measured from here on is the iterations' peak."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    try:
        CLEAR_REFS.write_text("5")
    except OSError:
        return MemoryWindow(rss_scope="process", rss_start_bytes=_proc_status_bytes("VmRSS"))
    scope = "iterations" if _proc_status_bytes("VmHWM") is not None else "process"
    return MemoryWindow(rss_scope=scope, rss_start_bytes=_proc_status_bytes("VmRSS"))


def peak_memory(device: torch.device, window: MemoryWindow) -> dict[str, Any]:
    """Peak memory since `window` opened: the figure to compare, and its parts.

    `rss_growth_iterations_bytes` (peak RSS of the iterations minus RSS when they started) is the
    training loop's own working memory, without the libraries and weights already resident.
    """
    window_rss = _proc_status_bytes("VmHWM") if window.rss_scope == "iterations" else None
    # getrusage and /proc read the kernel's high-water mark by different paths, a few KiB apart at
    # times; the whole process's peak is at least the iterations' own.
    process_rss = max(process_peak_rss_bytes(), window_rss or 0)
    cuda = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    if cuda is not None:
        compared, what = cuda, "torch.cuda.max_memory_allocated over the measured iterations"
    elif window_rss is not None:
        compared, what = window_rss, "peak RSS over the measured iterations (VmHWM after a reset)"
    else:
        compared, what = process_rss, "peak RSS of the whole process (model loading included)"
    growth = (
        window_rss - window.rss_start_bytes if window_rss is not None and window.rss_start_bytes is not None else None
    )
    return {
        "peak_memory_bytes": compared,
        "peak_memory_measure": what,
        "peak_rss_iterations_bytes": window_rss,
        "rss_growth_iterations_bytes": growth,
        "peak_rss_process_bytes": process_rss,
        "peak_cuda_allocated_bytes": cuda,
    }


class Stopwatch:
    """Accumulates the wall time of the phases of the current iteration (used where a trainer is
    timed from the outside, through wrappers around the functions it calls)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.seconds: dict[str, float] = {}

    def add(self, phase: str, seconds: float) -> None:
        self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds

    def take(self) -> dict[str, float]:
        """The phases' totals since the last `take`, and start over."""
        seconds, self.seconds = self.seconds, {}
        return seconds

    def timed(self, phase: str, function: Any) -> Any:
        """`function` wrapped so each call's wall time (CUDA work included) is added to `phase`."""

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            result = function(*args, **kwargs)
            synchronize(self.device)
            self.add(phase, time.perf_counter() - started)
            return result

        return wrapper


def throughput_report(
    *,
    implementation: str,
    settings: dict[str, Any],
    resolved_config: dict[str, Any],
    workload: Workload,
    iterations: Sequence[IterationTimes],
    wall_s: float,
    cpu_s: float,
    memory: dict[str, Any],
    prompt_fingerprint: str,
    peak_tflops: float | None,
) -> dict[str, Any]:
    """Every figure of a run, machine-readable (what `--json` writes and `print_report` shows).

    `wall_s` is the outer wall clock around all measured iterations; the phases are summed per
    iteration, so `time_s.total` (their sum) and `wall_s` agree up to loop overhead. `cpu_s` is
    the process's CPU time (`time.process_time`, all threads) over the same iterations.
    """
    count = len(iterations)
    phases = {
        "generate": sum(t.generate_s for t in iterations),
        "score": sum(t.score_s for t in iterations),
        "train": sum(t.train_s for t in iterations),
        "other": sum(t.other_s for t in iterations),
    }
    total = sum(phases.values())
    samples = workload.batch_size * count
    generated_tokens = samples * workload.response_length
    flops = model_flops_per_iteration(workload) * count
    achieved_tflops = flops / wall_s / 1e12
    return {
        "implementation": implementation,
        "settings": settings,
        "resolved_config": resolved_config,
        "iterations": count,
        "samples": samples,
        "generated_tokens": generated_tokens,
        "wall_s": wall_s,
        "cpu_s": cpu_s,
        "time_s": {**phases, "total": total},
        "time_share": {name: seconds / total for name, seconds in phases.items()},
        "samples_per_s": samples / wall_s,
        "generated_tokens_per_s": generated_tokens / wall_s,
        "samples_per_cpu_s": samples / cpu_s,
        **memory,
        "flops": {
            "formula": FLOPS_FORMULA,
            "parameters": workload.parameters,
            "model_flops": flops,
            "model_tflops_per_s": achieved_tflops,
            "peak_tflops": peak_tflops,
            "mfu": achieved_tflops / peak_tflops if peak_tflops else None,
        },
        "prompt_fingerprint": prompt_fingerprint,
        "per_iteration": [{**asdict(t), "total_s": t.total_s} for t in iterations],
    }


def _mib(value: int | None) -> str:
    return "n/a" if value is None else f"{value / 2**20:,.0f} MiB"


def print_report(report: dict[str, Any]) -> None:
    """The human-readable summary of `throughput_report`."""
    settings = report["settings"]
    times, share, flops = report["time_s"], report["time_share"], report["flops"]
    print(f"== PPO throughput: {report['implementation']} ==")
    print(
        f"model {settings['model']} ({flops['parameters']:,} parameters) on {settings['device']}"
        f"{' (bf16 autocast)' if settings['bf16'] else ''}, {settings['torch_threads']} torch threads"
    )
    print(
        f"batch {settings['batch_size']} (mini {settings['mini_batch_size']}, micro "
        f"{settings['micro_batch_size']}), prompt {settings['prompt_length']} tokens, response "
        f"{settings['response_length']} tokens (forced: no stop token), {settings['ppo_epochs']} PPO epoch(s); "
        f"{report['iterations']} measured iteration(s) after {settings['warmup_iterations']} warm-up"
    )
    print(f"samples/s            {report['samples_per_s']:.3f}")
    print(f"generated tokens/s   {report['generated_tokens_per_s']:.1f}")
    print(f"samples/CPU-second   {report['samples_per_cpu_s']:.3f}")
    print(f"wall time            {report['wall_s']:.2f} s (CPU time {report['cpu_s']:.2f} s)")
    for phase in ("generate", "score", "train", "other"):
        print(f"  {phase:<18} {times[phase]:8.2f} s  {100 * share[phase]:5.1f} %")
    print(f"peak memory          {_mib(report['peak_memory_bytes'])} ({report['peak_memory_measure']})")
    print(f"RSS growth in loop   {_mib(report['rss_growth_iterations_bytes'])} (peak minus RSS at the start)")
    print(f"peak RSS (process)   {_mib(report['peak_rss_process_bytes'])}")
    print(f"model TFLOP/s        {flops['model_tflops_per_s']:.4f}")
    if flops["mfu"] is not None:
        print(f"MFU                  {100 * flops['mfu']:.2f} % of {flops['peak_tflops']} TFLOP/s")
    print(f"FLOPs: {flops['formula']}")


def write_json(report: dict[str, Any], path: Path) -> None:
    """Write the report (whole, then renamed: a reader never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    temporary.replace(path)
