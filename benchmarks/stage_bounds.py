"""Each stage of a pipeline run against its own bound: its FLOPs at this machine's measured matmul rate.

    python benchmarks/stage_bounds.py RUN_DIR [--eval-dir DIR] [--threads N] [--dtype bfloat16] [--json OUT]

RUN_DIR is an `rlhf run` output (data/, sft/, reward/, judge_reward/, ppo/, eval/, each with metrics.json
and the training stages' history.params.json). The script measures the matmul rate in `--dtype` (float32,
or bfloat16 for a run that computed in bf16, whose decode steps then stream half the bytes; best of
5 1024^3 matmuls on `--threads` threads, the stages' count; a few seconds), rebuilds each stage's
batches from its own inputs (stage_tokens.py), counts their FLOPs from the model's config.json
(stage_flops.py) and prints per stage: token passes (real / padded), GFLOP, the bound in minutes, the
measured minutes, their ratio, and the stage with the most minutes above its bound. Decode steps are bound
by the slower of their FLOPs and streaming the weights once (`--bandwidth-gbs`, measured in
docs/rollout-engine.md). Method and figures: docs/stage-bounds.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from generation_bounds import SQUARE
from stage_flops import ModelShape, Work
from stage_tokens import evaluation_work, ppo_work, reward_work, sft_work
from transformers import AutoTokenizer

from rlhf_core.bf16_probe import REPEATS, matmul_gflops
from rlhf_core.config import load_config

STAGES = ("sft", "reward", "judge_reward", "ppo", "eval")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
BANDWIDTH_GBS = 18.0  # one core of this EPYC streaming memory: docs/rollout-engine.md (17.7-21 GB/s)


@dataclass(frozen=True)
class StageBound:
    """One stage's work, its bound at the measured rate, and what the run measured."""

    stage: str
    work: Work
    bound_minutes: float
    measured_minutes: float | None

    @property
    def ratio(self) -> float | None:
        return None if self.measured_minutes is None else self.measured_minutes / self.bound_minutes

    @property
    def gap_minutes(self) -> float | None:
        return None if self.measured_minutes is None else self.measured_minutes - self.bound_minutes


def read_json(path: Path) -> dict[str, Any] | None:
    """A JSON file's mapping, or None when it does not exist (a stage not run, an evaluation not done)."""
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def read_history(path: Path) -> list[dict[str, float]]:
    """The records of a history.jsonl."""
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def measured_minutes(stage_dir: Path) -> float | None:
    """The stage's own wall time from its metrics.json (`wall_seconds` or `wall_time_s`), in minutes."""
    metrics = read_json(stage_dir / "metrics.json") or {}
    seconds = metrics.get("wall_seconds", metrics.get("wall_time_s"))
    return None if seconds is None else float(seconds) / 60


def mean_reply_tokens(eval_dir: Path) -> tuple[float, float] | None:
    """Model A's and B's mean main-reply length in tokens (generations.jsonl), or None before it exists."""
    path = eval_dir / "generations.jsonl"
    if not path.is_file():
        return None
    rows = read_history(path)
    return sum(r["tokens_a"] for r in rows) / len(rows), sum(r["tokens_b"] for r in rows) / len(rows)


def stage_works(run_dir: Path, eval_dir: Path, config: dict[str, Any]) -> dict[str, Work]:
    """Every stage's `Work` that the run directory has the inputs of."""
    model_dir = run_dir / "sft" / "model"
    shape = ModelShape.from_config(json.loads((model_dir / "config.json").read_text(encoding="utf-8")))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    data = run_dir / "data"
    works: dict[str, Work] = {}
    params = {stage: read_json(run_dir / stage / "history.params.json") for stage in STAGES[:4]}
    if params["sft"]:
        works["sft"] = sft_work(shape, tokenizer, data, params["sft"])
    for stage in ("reward", "judge_reward"):
        if params[stage]:
            works[stage] = reward_work(shape, tokenizer, data, params[stage])
    if params["ppo"]:
        critic_only = int((read_json(run_dir / "ppo" / "metrics.json") or {}).get("critic_pretrain_steps", 0))
        history = read_history(run_dir / "ppo" / "history.jsonl")
        works["ppo"] = ppo_work(shape, tokenizer, data, params["ppo"], history, critic_only)
    works["eval"] = evaluation_work(shape, tokenizer, data, config, mean_reply_tokens(eval_dir))
    return works


def bounds(
    works: dict[str, Work], weight_bytes: int, gflops: float, bandwidth_gbs: float, minutes: dict[str, float | None]
) -> list[StageBound]:
    """Each stage's bound at the rates given (decode steps streaming `weight_bytes`), beside its measured minutes."""
    return [
        StageBound(stage, work, work.bound_seconds(gflops, bandwidth_gbs, weight_bytes) / 60, minutes.get(stage))
        for stage, work in works.items()
    ]


def largest_gap(rows: list[StageBound]) -> StageBound | None:
    """The measured stage with the most minutes above its bound."""
    measured = [row for row in rows if row.gap_minutes is not None]
    return max(measured, key=lambda row: row.gap_minutes or 0.0) if measured else None


def format_table(rows: list[StageBound]) -> list[str]:
    """The table's lines (markdown)."""
    lines = [
        "| stage | token passes real / padded | padding | GFLOP | bound min | measured min | measured / bound |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        work = row.work
        measured = "n/a" if row.measured_minutes is None else f"{row.measured_minutes:.1f}"
        ratio = "n/a" if row.ratio is None else f"{row.ratio:.1f}x"
        padding = work.padded_tokens / work.real_tokens - 1
        lines.append(
            f"| {row.stage} | {work.real_tokens:,} / {work.padded_tokens:,} | {100 * padding:.0f}% | "
            f"{work.flops / 1e9:,.0f} | {row.bound_minutes:.2f} | {measured} | {ratio} |"
        )
    summed = [row for row in rows if row.measured_minutes is not None]
    bound_sum, measured_sum = sum(r.bound_minutes for r in summed), sum(r.measured_minutes or 0.0 for r in summed)
    if summed:
        lines.append(
            f"| measured stages | | | | {bound_sum:.2f} | {measured_sum:.1f} | {measured_sum / bound_sum:.1f}x |"
        )
    return lines


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path, help="an `rlhf run` output directory")
    parser.add_argument("--eval-dir", type=Path, help="the run's evaluation output (default RUN_DIR/eval)")
    parser.add_argument("--config", type=Path, action="append", default=[], help="overlay for the evaluation settings")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="matmul threads (the stages')")
    parser.add_argument("--gflops", type=float, help="use this matmul rate instead of measuring it")
    parser.add_argument(
        "--dtype", choices=list(DTYPES), default="float32", help="the precision the run computed in (its log says)"
    )
    parser.add_argument("--bandwidth-gbs", type=float, default=BANDWIDTH_GBS, help="memory bandwidth for decode steps")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    eval_dir = args.eval_dir or args.run_dir / "eval"
    config = load_config(Path(__file__).resolve().parents[1] / "params.yaml", args.config).model_dump(mode="json")
    dtype = DTYPES[args.dtype]
    gflops = args.gflops or matmul_gflops(dtype, SQUARE, args.threads)
    source = "given" if args.gflops else f"measured, best of {REPEATS} 1024^3 matmuls on {args.threads} threads"
    print(f"{args.dtype} matmul rate {gflops:.1f} GFLOP/s ({source})", flush=True)
    model_config = json.loads((args.run_dir / "sft" / "model" / "config.json").read_text(encoding="utf-8"))
    shape = ModelShape.from_config(model_config)
    works = stage_works(args.run_dir, eval_dir, config)
    minutes = {stage: measured_minutes(args.run_dir / stage) for stage in STAGES[:4]}
    minutes["eval"] = measured_minutes(eval_dir)
    weight_bytes = shape.weight_bytes * dtype.itemsize // 4  # the lean engine's weights are in the run's dtype
    rows = bounds(works, weight_bytes, gflops, args.bandwidth_gbs, minutes)
    print(
        f"decode steps at {args.bandwidth_gbs:.1f} GB/s over {weight_bytes / 1e9:.3f} GB of weights; "
        f"{shape.matmul_parameters / 1e6:.1f} M matmul parameters"
    )
    print("\n".join(format_table(rows)))
    gap = largest_gap(rows)
    if gap is not None:
        print(f"largest remaining gap: {gap.stage}, {gap.gap_minutes:.1f} min above its bound ({gap.ratio:.1f}x)")
    if args.json:
        figures = {"dtype": args.dtype, "gflops": gflops, "bandwidth_gbs": args.bandwidth_gbs, "stages": [
            {**asdict(row.work), "stage": row.stage, "bound_minutes": row.bound_minutes,
             "measured_minutes": row.measured_minutes} for row in rows]}  # fmt: skip
        args.json.write_text(json.dumps(figures, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
