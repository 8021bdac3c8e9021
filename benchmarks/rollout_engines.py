"""The rollout engines side by side on generation alone: speed against the bound, and how exact each is.

    python benchmarks/rollout_engines.py --model smollm2 --batch-sizes 8,16,32 --json out.json
    python benchmarks/rollout_engines.py --config configs/tiny.yaml --prompt-length 96 --response-length 12

For each rollout batch size, on the same fixed-length prompts (`workload.py`), each engine generates
`--response-length` tokens per prompt (no stop token, so every reply is full length) `--repeats` times from
the same seed: `hf` (transformers `generate` on the policy), `lean` (float32, the default `inverse_cdf`
sampler and C kernel), `lean-onednn` (the same with `ppo.rollout.kernel: onednn`), `lean-multinomial`
(float32, drawing as `generate` does, so its tokens equal `hf`'s) and `lean-bf16` (`ppo.rollout.dtype:
bfloat16`). Reported per engine: median seconds per rollout, replies/s, tokens/s,
the share of the bound's speed reached (generation_bounds.py), whether its tokens equal `hf`'s, and its
log-probs of the tokens it sampled against the float32 scoring pass the trainer uses
(`ppo.scoring.response_logprobs`): the mean and largest absolute gap, and the mean signed gap, which
estimates KL(engine || float32 policy) per token, the size of the off-policy error. For `hf` the
log-probs come from `generate`'s own scores.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from generation_bounds import SQUARE, generation_bound, memory_bandwidth_gbs
from measurement import synchronize
from torch import Tensor
from transformers import PreTrainedModel
from workload import SYNTHETIC, benchmark_prompts

from rlhf_core.bf16_probe import matmul_gflops
from rlhf_core.config import RolloutConfig, load_config
from rlhf_core.models.base import load_base_model
from rlhf_core.models.chat import encode_prompt
from rlhf_core.ppo.scoring import response_logprobs
from rlhf_core.rollout.engine import Generation, HFGenerateEngine, RolloutEngine, SamplingParams
from rlhf_core.rollout.generation import left_pad, sampling_config
from rlhf_core.rollout.lean_engine import LeanEngine

REPO_ROOT = Path(__file__).resolve().parents[1]
ENGINES = {  # name: (ppo.rollout.engine, dtype, sampler, kernel)
    "hf": ("hf", "float32", "multinomial", "blocked"),
    "lean": ("lean", "float32", "inverse_cdf", "blocked"),
    "lean-onednn": ("lean", "float32", "inverse_cdf", "onednn"),
    "lean-multinomial": ("lean", "float32", "multinomial", "blocked"),
    "lean-bf16": ("lean", "bfloat16", "inverse_cdf", "onednn"),
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", action="append", default=[], type=Path, help="overlay (repeatable)")
    parser.add_argument("--model", choices=["tiny", "smollm2"], help="model.kind (default: the config's)")
    parser.add_argument("--batch-sizes", default="8,16,32", help="rollout batch sizes, comma-separated")
    parser.add_argument("--prompt-length", type=int, default=64)
    parser.add_argument("--response-length", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3, help="timed rollouts per engine and batch size")
    parser.add_argument("--engines", default=",".join(ENGINES), help=f"some of {', '.join(ENGINES)}")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--data", default=SYNTHETIC, help=f"HH-RLHF pairs file or '{SYNTHETIC}'")
    parser.add_argument("--json", type=Path, help="write every figure to this JSON file")
    return parser.parse_args(argv)


def hf_logprobs(policy: PreTrainedModel, prompt: tuple[Tensor, Tensor], params: SamplingParams, seed: int) -> Tensor:
    """`generate`'s own log-probs of the tokens it samples from `seed` (what `hf` draws from that seed)."""
    generation_config = sampling_config(params.settings, list(params.stop_ids), params.pad_id)
    generation_config.output_scores = generation_config.return_dict_in_generate = True
    torch.manual_seed(seed)
    output = policy.generate(input_ids=prompt[0], attention_mask=prompt[1], generation_config=generation_config)
    tokens = output.sequences[:, prompt[0].shape[1] :]
    scores = torch.stack(output.scores, dim=1).float()
    return torch.log_softmax(scores, dim=-1).gather(2, tokens[..., None]).squeeze(-1)


def same_tokens(generation: Generation, reference: Generation | None, sampler: str) -> bool | None:
    """Whether `generation` drew `hf`'s tokens (None when `hf` did not run first, or when the engine draws
    with other random numbers than `generate`: the `inverse_cdf` sampler)."""
    if reference is None or sampler != "multinomial":
        return None
    return bool(torch.equal(generation.response_ids, reference.response_ids))


def logprob_gaps(engine_logprobs: Tensor, scored: Tensor) -> dict[str, float]:
    difference = engine_logprobs - scored
    return {
        "logprob_gap_mean": float(difference.abs().mean()),
        "logprob_gap_max": float(difference.abs().max()),
        "kl_estimate_per_token": float(difference.mean()),
    }


def time_engine(
    engine: RolloutEngine, prompt: tuple[Tensor, Tensor], params: SamplingParams, repeats: int, device: torch.device
) -> tuple[float, Generation]:
    """Median seconds of `repeats` seeded rollouts (after one warm-up), and the last rollout."""
    engine.generate(*prompt, params, seed=0)
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        generation = engine.generate(*prompt, params, seed=0)
        synchronize(device)
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds), generation


def measure_batch(
    policy: PreTrainedModel, prompt: tuple[Tensor, Tensor], args: argparse.Namespace, device: torch.device,
    machine: tuple[float, dict[str, float]],
) -> dict[str, Any]:  # fmt: skip
    """Every engine's figures at one batch size (module doc)."""
    batch, length = prompt[0].shape[0], args.response_length
    bandwidth, gflops = machine
    results: dict[str, Any] = {}
    reference: Generation | None = None
    for name in args.engines.split(","):
        kind, dtype, sampler, kernel = ENGINES[name]
        settings = RolloutConfig(max_new_tokens=length, engine=kind, dtype=dtype, sampler=sampler, kernel=kernel)
        params = SamplingParams(settings, (), pad_id=0)
        engine = HFGenerateEngine(policy) if kind == "hf" else LeanEngine(policy, settings, batch)
        seconds, generation = time_engine(engine, prompt, params, args.repeats, device)
        with torch.no_grad():
            scored = response_logprobs(policy, *prompt, generation.response_ids, generation.response_mask, 1.0)[0]
        own = hf_logprobs(policy, prompt, params, seed=0) if kind == "hf" else generation.logprobs
        reference = generation if kind == "hf" else reference
        bound = generation_bound(
            policy, getattr(torch, dtype), batch, args.prompt_length, length, bandwidth, gflops[dtype]
        )
        results[name] = {
            "seconds": seconds,
            "replies_per_s": batch / seconds,
            "tokens_per_s": batch * length / seconds,
            "bound_s": bound.generate_s,
            "bound_over_measured": bound.generate_s / seconds,
            "same_tokens_as_hf": same_tokens(generation, reference, sampler),
            **logprob_gaps(own.to(scored.device), scored),
        }
    return results


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    overrides = [f"model.kind={args.model}"] if args.model else []
    config = load_config(REPO_ROOT / "params.yaml", overlays=args.config, overrides=overrides)
    device = torch.device(args.device)
    policy, tokenizer = load_base_model(config.model, device)
    sizes = [int(size) for size in args.batch_sizes.split(",")]
    prompts = benchmark_prompts(tokenizer, args.data, max(sizes), args.prompt_length, config.seed)
    ids = [encode_prompt(tokenizer, prompt.messages, args.prompt_length) for prompt in prompts]
    machine = (
        memory_bandwidth_gbs(),
        {d: matmul_gflops(getattr(torch, d), SQUARE, torch.get_num_threads()) for d in ("float32", "bfloat16")},
    )
    print(f"memory bandwidth {machine[0]:.1f} GB/s, matmul GFLOP/s {machine[1]}, {torch.get_num_threads()} threads")
    report: dict[str, Any] = {"memory_bandwidth_gbs": machine[0], "matmul_gflops": machine[1], "batches": {}}
    for batch in sizes:
        prompt = left_pad(ids[:batch], tokenizer.pad_token_id, device)
        results = measure_batch(policy, prompt, args, device, machine)
        report["batches"][batch] = results
        for name, row in results.items():
            print(
                f"batch {batch:<3} {name:<10} {row['seconds']:7.2f} s  {row['replies_per_s']:6.2f} replies/s "
                f"{row['tokens_per_s']:7.1f} tokens/s  {100 * row['bound_over_measured']:4.0f}% of bound  "
                f"same tokens as hf: {row['same_tokens_as_hf']}  log-prob gap mean {row['logprob_gap_mean']:.2e} "
                f"max {row['logprob_gap_max']:.2e}  KL est {row['kl_estimate_per_token']:.2e}"
            )
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
