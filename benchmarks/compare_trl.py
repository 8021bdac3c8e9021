"""Run this project's PPO trainer and TRL's on the same settings, back to back, and print the ratios.

    bash benchmarks/setup_trl_venv.sh                      # once: TRL's virtual environment
    python benchmarks/compare_trl.py --rounds 2 -- --config configs/tiny.yaml --iterations 3
    python benchmarks/compare_trl.py -- --model smollm2 --batch-size 8 --prompt-length 64 \
        --response-length 32 --iterations 2

Everything after `--` goes to `ppo_throughput.py`; TRL's run mirrors the settings that run resolved
(`trl_ppo_throughput.py --settings`). Each round runs ours, then TRL, in the same conditions; with
several rounds the figures are medians (on a loaded machine the ratio is what to read, not the
seconds). Prints both resolved configurations side by side, the figures with the ratio ours / TRL,
and the targets (samples/s at least 4x TRL's on the tiny model and 2.5x on SmolLM2, at no
more peak memory). `--baseline-engine hf` also runs ours with that rollout engine in every round
(before TRL) and checks the generation target: generation time per iteration at most half the
baseline's. TRL runs with ours' C allocator settings (`--trl-host-allocator mirror`, the default; see
ppo_throughput.py `--host-allocator`). Reports go to `--out` (default benchmarks/results/, git-ignored):
`ours-<round>.json`,
`baseline-<round>.json`, `trl-<round>.json` and `comparison.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from generation_bounds import print_generation

HERE = Path(__file__).resolve().parent
TRL_PYTHON = HERE / ".venv-trl" / "bin" / "python"
SAMPLES_PER_S_TARGETS = {"tiny": 4.0, "smollm2": 2.5}  # targets, ours / TRL
GENERATION_TARGET = 0.5  # generation s / iteration at most half the baseline engine's
HIDDEN_SETTINGS = {"model_config"}  # long, and equal by construction (TRL builds from it)
FIGURES = (  # (label, path in the report)
    ("samples/s", ("samples_per_s",)),
    ("generated tokens/s", ("generated_tokens_per_s",)),
    ("samples / CPU-second", ("samples_per_cpu_s",)),
    ("generate s / iteration", ("time_s", "generate")),
    ("generate share", ("time_share", "generate")),
    ("score s / iteration", ("time_s", "score")),
    ("train s / iteration", ("time_s", "train")),
    ("other s / iteration", ("time_s", "other")),
    ("peak memory MiB", ("peak_memory_bytes",)),
    ("RSS growth in loop MiB", ("rss_growth_iterations_bytes",)),
    ("peak RSS (process) MiB", ("peak_rss_process_bytes",)),
    ("model TFLOP/s", ("flops", "model_tflops_per_s")),
)


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    argv = list(sys.argv[1:] if argv is None else argv)
    ours = argv[argv.index("--") + 1 :] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=1, help="ours-then-TRL rounds; figures are medians")
    parser.add_argument("--out", type=Path, default=HERE / "results", help="where the JSON reports go")
    parser.add_argument("--trl-python", type=Path, default=TRL_PYTHON, help="the TRL venv's python")
    parser.add_argument(
        "--baseline-engine", choices=["hf", "lean"], help="also run ours with this ppo.rollout.engine each round"
    )
    parser.add_argument(
        "--trl-host-allocator", choices=["mirror", "default"], default="mirror",
        help="mirror: TRL runs with ours' C allocator settings (glibc malloc variables); "
        "default: with the C library's own",
    )  # fmt: skip
    args = parser.parse_args(own)
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    if not args.trl_python.is_file():
        parser.error(f"{args.trl_python} not found: run `bash benchmarks/setup_trl_venv.sh` first")
    return args, ours


def run(command: list[str], environment: dict[str, str] | None = None) -> None:
    """Run one benchmark process (with `environment` added to ours), its output shown as it comes;
    fail loudly if it fails."""
    shown = " ".join(f"{name}={value}" for name, value in (environment or {}).items())
    print("$ " + " ".join([shown, *command] if shown else command), flush=True)
    subprocess.run(command, check=True, env={**os.environ, **(environment or {})})


def trl_environment(ours_settings: dict[str, Any], mirror: bool) -> dict[str, str]:
    """glibc's malloc variables for TRL's process: ours' (`host_allocator`) when mirrored and tuned."""
    allocator = ours_settings["host_allocator"]
    return dict(allocator) if mirror and isinstance(allocator, dict) else {}


def figure(report: dict[str, Any], path: tuple[str, ...]) -> float:
    """One figure of a report; per-phase seconds are per iteration, memory in MiB."""
    value: Any = report
    for key in path:
        value = value[key]
    if value is None:  # a figure this platform cannot measure (RSS outside Linux)
        return float("nan")
    if path[0] == "time_s":
        return value / report["iterations"]
    return value / 2**20 if path[0].endswith("_bytes") else value


def median_figures(reports: list[dict[str, Any]]) -> dict[str, float]:
    return {label: statistics.median(figure(r, path) for r in reports) for label, path in FIGURES}


def print_settings(ours: dict[str, Any], trl: dict[str, Any]) -> None:
    """The two runs' settings side by side; '*' marks a difference."""
    print("\n== resolved settings: ours | TRL ('*': they differ) ==")
    for key in [k for k in {**ours, **trl} if k not in HIDDEN_SETTINGS]:
        left, right = ours.get(key, "-"), trl.get(key, "-")
        print(f"{'*' if left != right else ' '} {key:<22} {left!s:<44} {right}")


def print_resolved(name: str, resolved: dict[str, Any]) -> None:
    print(f"\n== {name}: full resolved configuration ==")
    for section, values in resolved.items():
        print(f"[{section}] " + ", ".join(f"{key}={value}" for key, value in values.items()))


def print_ratios(ours: dict[str, float], trl: dict[str, float]) -> dict[str, float]:
    """The figures and ours / TRL for each (for times and memory, below 1 means ours is better)."""
    print(f"\n== figures (median): {'ours':>12} {'TRL':>12} {'ours/TRL':>10} ==")
    ratios = {}
    for label, _ in FIGURES:
        ratios[label] = ours[label] / trl[label] if trl[label] else float("nan")
        print(f"{label:<24} {ours[label]:12.4g} {trl[label]:12.4g} {ratios[label]:10.3f}")
    return ratios


def check_targets(model: str, ratios: dict[str, float]) -> dict[str, Any]:
    """The issue's targets for this model (none for other models), on wall-clock samples/s and, steadier
    on a loaded machine, on samples per CPU-second."""
    target = SAMPLES_PER_S_TARGETS.get(model)
    result: dict[str, Any] = {"samples_per_s_target": target}
    wanted = f">= {target}x" if target is not None else "(no target for this model)"
    for label, key in (("samples/s", "samples_per_s_met"), ("samples / CPU-second", "samples_per_cpu_s_met")):
        result[key] = None if target is None else ratios[label] >= target
        print(f"\ntarget {label} ours/TRL {wanted}: {ratios[label]:.2f}x -> {result[key]}", end="")
    result["peak_memory_met"] = ratios["peak memory MiB"] <= 1.0
    print(f"\ntarget peak memory ours <= TRL: {ratios['peak memory MiB']:.2f}x -> {result['peak_memory_met']}")
    return result


def check_generation(ours: dict[str, float], baseline: dict[str, float], engine: str) -> dict[str, Any]:
    """Ours against ours with the baseline engine: generation time per iteration, and samples/s."""
    ratio = ours["generate s / iteration"] / baseline["generate s / iteration"]
    speedup = ours["samples/s"] / baseline["samples/s"]
    met = ratio <= GENERATION_TARGET
    print(f"\ntarget generate s / iteration ours / ours with engine {engine} <= {GENERATION_TARGET}: "
          f"{ratio:.2f} -> {met} (samples/s {speedup:.2f}x)")  # fmt: skip
    return {"baseline_engine": engine, "generate_ratio": ratio, "samples_per_s_ratio": speedup, "generate_met": met}


def main(argv: list[str] | None = None) -> int:
    args, ours_options = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    ours_reports, trl_reports, baseline_reports = [], [], []
    for number in range(1, args.rounds + 1):
        ours_json, trl_json = args.out / f"ours-{number}.json", args.out / f"trl-{number}.json"
        run([sys.executable, str(HERE / "ppo_throughput.py"), *ours_options, "--json", str(ours_json)])
        ours_report = json.loads(ours_json.read_text(encoding="utf-8"))
        if args.baseline_engine:
            baseline_json = args.out / f"baseline-{number}.json"
            run([sys.executable, str(HERE / "ppo_throughput.py"), *ours_options, "--engine", args.baseline_engine,
                 "--json", str(baseline_json)])  # fmt: skip
            baseline_reports.append(json.loads(baseline_json.read_text(encoding="utf-8")))
        peak = ours_report["flops"]["peak_tflops"]
        run(
            [str(args.trl_python), str(HERE / "trl_ppo_throughput.py"), "--settings", str(ours_json),
             "--json", str(trl_json), *(["--peak-tflops", str(peak)] if peak else [])],
            trl_environment(ours_report["settings"], args.trl_host_allocator == "mirror"),
        )  # fmt: skip
        ours_reports.append(ours_report)
        trl_reports.append(json.loads(trl_json.read_text(encoding="utf-8")))
    print_settings(ours_reports[0]["settings"], trl_reports[0]["settings"])
    print_resolved("ours", ours_reports[0]["resolved_config"])
    print_resolved("TRL", trl_reports[0]["resolved_config"])
    print("\n== ours: generation against its bounds (first round) ==")
    print_generation(ours_reports[0]["generation"])
    ours, trl = median_figures(ours_reports), median_figures(trl_reports)
    ratios = print_ratios(ours, trl)
    targets = check_targets(ours_reports[0]["settings"]["model"], ratios)
    if baseline_reports:
        targets["generation"] = check_generation(ours, median_figures(baseline_reports), args.baseline_engine)
    comparison = {"rounds": args.rounds, "ours": ours, "trl": trl, "ours_over_trl": ratios, "targets": targets}
    (args.out / "comparison.json").write_text(json.dumps(comparison, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
