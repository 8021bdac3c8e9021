"""How the evaluation's generation batch size trades time for the same replies' distribution.

The evaluation samples each model's replies to the held-out prompts in batches of `evaluation.batch_size`,
and a batch runs until its longest reply ends (up to `evaluation.generation.max_new_tokens`). A decode step
streams every weight once whatever the batch, so a larger batch shares that traffic among more replies,
and wastes more steps on rows that have finished.
This script times `generate_replies` exactly as the evaluation calls it, on a run's SFT model and the
first `--prompts` evaluation prompts, at each batch size, interleaved over `--repeats` rounds, and
prints replies per second and the replies' mean length and finished share (the batch size changes
which replies are drawn, not their distribution).

    python benchmarks/eval_generation.py runs/<run> --batch-sizes 8,16,32 --prompts 32
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from rlhf_core.config import load_config
from rlhf_core.evaluation.generation import generate_replies
from rlhf_core.evaluation.prompts import evaluation_prompts
from rlhf_core.models.base import DTYPES
from rlhf_core.models.loading import load_causal_lm

REPO_ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", type=Path, help="a pipeline run directory (its data/ and sft/model)")
    parser.add_argument("--params", type=Path, default=REPO_ROOT / "params.yaml")
    parser.add_argument("--config", type=Path, action="append", default=[], help="overlay (repeatable)")
    parser.add_argument("--batch-sizes", default="8,16,32", help="comma-separated")
    parser.add_argument("--prompts", type=int, default=32, help="the first N evaluation prompts")
    parser.add_argument("--repeats", type=int, default=2, help="rounds over the batch sizes")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    config = load_config(args.params, overlays=args.config)
    settings = config.evaluation.generation
    prompts = [prompt.prompt for prompt in evaluation_prompts(args.run / "data", args.prompts)]
    dtype = DTYPES[config.model.dtype]  # as the evaluation loads it (rlhf_core/stages/evaluate.py)
    model, tokenizer = load_causal_lm(args.run / "sft" / "model", dtype=dtype, device=torch.device("cpu"))
    sizes = [int(size) for size in args.batch_sizes.split(",")]
    seconds: dict[int, list[float]] = {size: [] for size in sizes}
    lengths: dict[int, list[int]] = {size: [] for size in sizes}
    finished: dict[int, list[bool]] = {size: [] for size in sizes}
    print(f"{len(prompts)} prompts, {settings.max_new_tokens} new tokens at most, {torch.get_num_threads()} threads")
    for round_index in range(args.repeats):
        for size in sizes:
            start = time.perf_counter()
            replies = generate_replies(model, tokenizer, prompts, settings, size, config.seed + round_index)
            seconds[size].append(time.perf_counter() - start)
            lengths[size] += [reply.tokens for reply in replies]
            finished[size] += [reply.finished for reply in replies]
    print("| batch | seconds (median) | replies / s | relative time | mean tokens | finished |")
    print("|---|---|---|---|---|---|")
    baseline = statistics.median(seconds[sizes[0]])
    for size in sizes:
        median = statistics.median(seconds[size])
        print(
            f"| {size} | {median:.1f} | {len(prompts) / median:.2f} | {median / baseline:.2f} "
            f"| {statistics.mean(lengths[size]):.1f} | {statistics.mean(finished[size]):.0%} |"
        )


if __name__ == "__main__":
    main()
