"""Throughput of this project's PPO-max trainer (`rlhf_core.ppo.trainer.PPOTrainer`).

Runs `--warmup-iterations` then `--iterations` full PPO iterations (rollout: generation and the
no-grad scoring passes, experience assembly; update: the PPO epochs) on fixed-length prompts and
prints samples/s, generated tokens/s, the time split, peak memory and model FLOP utilisation
(`measurement.py` says exactly what each figure is), then generation against its memory-bandwidth and
compute bounds and, with `--sweep 8,16,32`, replies per second at other rollout batch sizes
(`generation_bounds.py`). `--json OUT` writes every figure.

    python benchmarks/ppo_throughput.py --config configs/tiny.yaml --iterations 3
    python benchmarks/ppo_throughput.py --model smollm2 --batch-size 8 --prompt-length 64 \
        --response-length 32 --iterations 3 --json benchmarks/results/ours-smollm2.json

The models are built the way the PPO stage builds them (`rlhf_core.stages.ppo.load_ppo_models`),
from the base model instead of SFT and reward-model outputs (throughput does not depend on the
weights): policy and reference from `model.kind`, the reward model as that backbone with a fresh
scalar head, the critic from the reward model (`ppo.critic_init: reward`, or SFT + a fresh head).

Fixed response length: the trainer is given no stop token (`trainer.maker.stop_ids = []`), so every
response runs to exactly `--response-length` tokens, and the run fails if one does not; TRL's side
forces the same, so both generate batch x response-length tokens per iteration. Every prompt is
exactly `--prompt-length` tokens (`workload.py`). Not measured: validation, checkpoints, the
collapse guard (none of them part of an iteration's throughput). `ppo.critic_pretrain_steps` is
forced to 0 so every iteration trains the policy and the critic.

Configuration: params.yaml, then benchmarks/ppo_benchmark.yaml (PPO-ptx off, as TRL has none),
then each `--config` overlay, then the options below.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from generation_bounds import (
    SQUARE,
    batch_sweep,
    bound_report,
    generation_bound,
    memory_bandwidth_gbs,
    print_generation,
)
from measurement import (
    IterationTimes,
    Workload,
    peak_memory,
    print_report,
    start_memory_window,
    synchronize,
    throughput_report,
    write_json,
)
from transformers import PreTrainedModel, PreTrainedTokenizerBase
from workload import SHARED_PAIRS, SYNTHETIC, benchmark_prompts, fingerprint

from rlhf_core.bf16_probe import matmul_gflops
from rlhf_core.config import Config, load_config
from rlhf_core.models.base import DTYPES, base_model_location, load_base_model, load_base_tokenizer
from rlhf_core.models.chat import encode_prompt, end_of_turn_id
from rlhf_core.models.heads import Critic, RewardModel
from rlhf_core.ppo.experience_maker import PPOModels
from rlhf_core.ppo.scoring import RewardModelScorer
from rlhf_core.ppo.trainer import PPOData, PPOTrainer
from rlhf_core.rollout.generation import left_pad
from rlhf_core.stages.precision import resolve_precision
from rlhf_core.training.host_allocator import keep_freed_memory, tuned_environment
from rlhf_core.training.loop import seed_everything

REPO_ROOT = Path(__file__).resolve().parents[1]
PARAMS = REPO_ROOT / "params.yaml"
BENCHMARK_OVERLAY = Path(__file__).resolve().parent / "ppo_benchmark.yaml"


def batch_sizes(text: str) -> list[int]:
    """`--sweep 8,16,32` -> [8, 16, 32]."""
    sizes = [int(part) for part in text.split(",") if part.strip()]
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated batch sizes >= 1, got {text!r}")
    return sizes


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", action="append", default=[], type=Path, help="overlay (repeatable)")
    parser.add_argument("--model", choices=["tiny", "smollm2"], help="model.kind (default: the config's)")
    parser.add_argument("--iterations", type=int, default=3, help="measured PPO iterations")
    parser.add_argument("--warmup-iterations", type=int, default=1, help="iterations run first, not measured")
    parser.add_argument("--batch-size", type=int, help="ppo.rollout_batch_size (prompts per iteration)")
    parser.add_argument("--mini-batch-size", type=int, help="ppo.mini_batch_size (rows per optimizer step)")
    parser.add_argument("--micro-batch-size", type=int, help="ppo.micro_batch_size (rows per forward pass)")
    parser.add_argument("--prompt-length", type=int, help="tokens per prompt (ppo.max_prompt_tokens)")
    parser.add_argument("--response-length", type=int, help="tokens per response (ppo.rollout.max_new_tokens)")
    parser.add_argument(
        "--scoring-batch-size", type=int, help="ppo.scoring_batch_size (rows per no-grad scoring pass; default: "
        "the rollout batch, as TRL's local_rollout_forward_batch_size is set on its side)",
    )  # fmt: skip
    parser.add_argument("--ppo-epochs", type=int, help="ppo.ppo_epochs")
    parser.add_argument("--engine", choices=["hf", "lean"], help="ppo.rollout.engine (default: the config's)")
    parser.add_argument(
        "--rollout-dtype", choices=["float32", "bfloat16"], help="ppo.rollout.dtype (lean engine weights)"
    )
    parser.add_argument(
        "--sweep", type=batch_sizes, default=[], help="after the iterations, generation alone at these rollout "
        "batch sizes, e.g. 8,16,32: replies per second against the bound (generation_bounds.py)",
    )  # fmt: skip
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument(
        "--bf16", choices=["auto", "on", "off"], default="off", help="distributed.bf16 (default off: float32)"
    )
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    parser.add_argument(
        "--host-allocator", choices=["tuned", "default"], default="tuned",
        help="tuned: glibc keeps freed memory, as every training stage sets it "
        "(rlhf_core/training/host_allocator.py); default: the C library's own",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, help="seed (default: the config's)")
    parser.add_argument(
        "--data",
        default=str(SHARED_PAIRS) if SHARED_PAIRS.is_file() else SYNTHETIC,
        help=f"HH-RLHF pairs file to take prompts from, or '{SYNTHETIC}' (default: the shared pairs if present)",
    )
    parser.add_argument("--peak-tflops", type=float, help="accelerator peak TFLOP/s, for the MFU figure")
    parser.add_argument("--json", type=Path, help="write every figure to this JSON file")
    args = parser.parse_args(argv)
    if args.iterations < 1 or args.warmup_iterations < 0:
        parser.error("--iterations must be >= 1 and --warmup-iterations >= 0")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")
    return args


def resolve_config(args: argparse.Namespace) -> Config:
    """params.yaml + the benchmark overlay + `--config` overlays + the options (see module doc)."""
    options = {
        "model.kind": args.model,
        "seed": args.seed,
        "ppo.rollout_batch_size": args.batch_size,
        "ppo.mini_batch_size": args.mini_batch_size,
        "ppo.micro_batch_size": args.micro_batch_size,
        "ppo.max_prompt_tokens": args.prompt_length,
        "ppo.rollout.max_new_tokens": args.response_length,
        "ppo.ppo_epochs": args.ppo_epochs,
        "ppo.scoring_batch_size": args.scoring_batch_size,
        "ppo.rollout.engine": args.engine,
        "ppo.rollout.dtype": args.rollout_dtype,
    }
    overrides = [f"{key}={value}" for key, value in options.items() if value is not None]
    overrides += ["ppo.critic_pretrain_steps=0", f"distributed.bf16={args.bf16}"]
    config = load_config(PARAMS, overlays=[BENCHMARK_OVERLAY, *args.config], overrides=overrides)
    if args.scoring_batch_size is None and config.ppo.scoring_batch_size is None:
        # TRL scores the whole rollout per pass (trl_ppo_throughput.py); so does ours unless told otherwise
        overrides.append(f"ppo.scoring_batch_size={config.ppo.rollout_batch_size}")
        config = load_config(PARAMS, overlays=[BENCHMARK_OVERLAY, *args.config], overrides=overrides)
    return config


def build_models(config: Config, device: torch.device) -> tuple[PPOModels, PreTrainedTokenizerBase]:
    """The four PPO models from the base model, in the dtypes the PPO stage uses (module doc)."""
    frozen_dtype = DTYPES[config.ppo.frozen_models_dtype or config.model.dtype]
    policy, tokenizer = load_base_model(config.model, device)
    reference, _ = load_base_model(config.model, device)
    reward_backbone, _ = load_base_model(config.model, device)
    reward_model = RewardModel.from_causal_lm(reward_backbone, end_of_turn_id(tokenizer), seed=config.seed)
    if config.ppo.critic_init == "reward":
        critic = Critic.from_reward_model(reward_model)
    else:
        critic = Critic.from_causal_lm(load_base_model(config.model, device)[0], seed=config.seed)
    reference.to(dtype=frozen_dtype)
    reward_model.to(dtype=frozen_dtype).requires_grad_(False)
    scorer = RewardModelScorer(reward_model, config.ppo.scoring_rows)
    return PPOModels(policy=policy, reference=reference, critic=critic, scorer=scorer), tokenizer


def model_path(config: Config) -> str | None:
    """Where the base model's weights are read from (None: the tiny model is built from its seed)."""
    return None if config.model.kind == "tiny" else str(base_model_location(config.model))


def tokenizer_path(config: Config) -> str:
    """Where the tokenizer is read from (the tiny model uses SmolLM2's)."""
    return str(base_model_location(config.model))


def benchmark_settings(
    config: Config,
    args: argparse.Namespace,
    policy: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    device: torch.device,
    prompts: int,
    allocator_tuned: bool,
) -> dict[str, Any]:
    """What the run did, in the terms both implementations share; TRL's side mirrors these."""
    ppo = config.ppo
    return {
        "model": config.model.kind,
        "model_path": model_path(config),
        "tokenizer_path": tokenizer_path(config),
        "model_config": policy.config.to_dict(),
        "model_seed": config.model.tiny.seed,
        "dtype": config.model.dtype,
        "frozen_models_dtype": ppo.frozen_models_dtype or config.model.dtype,
        "device": device.type,
        "bf16": config.distributed.uses_bf16,
        "torch_threads": torch.get_num_threads(),
        "host_allocator": tuned_environment() if allocator_tuned else "default",
        "batch_size": ppo.rollout_batch_size,
        "mini_batch_size": ppo.mini_batch_size,
        "micro_batch_size": ppo.micro_batch_size,
        "scoring_batch_size": ppo.scoring_rows,
        "prompt_length": ppo.max_prompt_tokens,
        "response_length": ppo.rollout.max_new_tokens,
        "ppo_epochs": ppo.ppo_epochs,
        "iterations": args.iterations,
        "warmup_iterations": args.warmup_iterations,
        "seed": config.seed,
        "data": args.data,
        "prompt_count": prompts,
        "temperature": ppo.rollout.temperature,
        "rollout_engine": ppo.rollout.engine,
        "rollout_dtype": ppo.rollout.dtype if ppo.rollout.engine == "lean" else config.model.dtype,
        "kl_coef": ppo.kl_coef,
        "clip_eps": ppo.clip_eps,
        "value_clip": ppo.value_clip,
        "gamma": ppo.gamma,
        "lam": ppo.lam,
        "policy_lr": ppo.policy_lr,
        "critic_lr": ppo.critic_lr,
        "max_grad_norm": ppo.max_grad_norm,
        "trainable_top_layers": ppo.trainable_top_layers,
        "lora": ppo.lora.enabled,
        "ptx_coef": ppo.ptx_coef,
        "stop_token": None,
        "pad_token": tokenizer.pad_token,
    }


@dataclass(frozen=True)
class Measurement:
    """The measured iterations' phase times, the outer wall and CPU clocks around them, peak memory."""

    iterations: list[IterationTimes]
    wall_s: float
    cpu_s: float
    memory: dict[str, Any]


def run_iteration(trainer: PPOTrainer, step: int, device: torch.device, expected_tokens: int) -> IterationTimes:
    """One PPO iteration, timed: generation and scoring as the trainer logs them, training as the
    whole `learn` call, other as the rest of the rollout (experience assembly and monitors)."""
    started = time.perf_counter()
    experience, rollout_metrics = trainer.rollout(step)
    synchronize(device)
    rolled_out = time.perf_counter()
    trainer.learn(experience, step)
    synchronize(device)
    learned = time.perf_counter()
    generated = int(rollout_metrics["rollout/generated_tokens"])
    if generated != expected_tokens:
        raise RuntimeError(
            f"iteration {step} generated {generated} tokens, expected batch x response length = "
            f"{expected_tokens}: a response stopped early, so the comparison would not be like for like"
        )
    generate_s, score_s = rollout_metrics["time/generate_s"], rollout_metrics["time/score_s"]
    return IterationTimes(
        generate_s=generate_s,
        score_s=score_s,
        train_s=learned - rolled_out,
        other_s=(rolled_out - started) - generate_s - score_s,
    )


def measure(
    trainer: PPOTrainer, warmup: int, iterations: int, device: torch.device, expected_tokens: int
) -> Measurement:
    """Run the warm-up iterations, then the measured ones under a fresh peak-memory window."""
    for step in range(1, warmup + 1):
        run_iteration(trainer, step, device, expected_tokens)
    synchronize(device)
    window = start_memory_window(device)
    started, cpu_started = time.perf_counter(), time.process_time()
    times = [
        run_iteration(trainer, step, device, expected_tokens) for step in range(warmup + 1, warmup + iterations + 1)
    ]
    synchronize(device)
    wall_s, cpu_s = time.perf_counter() - started, time.process_time() - cpu_started
    return Measurement(iterations=times, wall_s=wall_s, cpu_s=cpu_s, memory=peak_memory(device, window))


def sweep_generation(trainer: PPOTrainer, prompt_ids: list[list[int]], device: torch.device, length: int) -> Any:
    """`batch_sweep`'s callable: the trainer's own generation on `batch` benchmark prompts, timed."""

    def generate(batch: int) -> float:
        prompt = left_pad([prompt_ids[i % len(prompt_ids)] for i in range(batch)], trainer.maker.pad_id, device)
        started = time.perf_counter()
        generation = trainer.maker.generate(prompt)
        synchronize(device)
        if int(generation.response_mask.sum()) != batch * length:
            raise RuntimeError("a sweep reply stopped early: the figure would not be per full-length reply")
        return time.perf_counter() - started

    return generate


def generation_section(
    trainer: PPOTrainer, config: Config, args: argparse.Namespace, measurement: Measurement,
    prompt_ids: list[list[int]], device: torch.device,
) -> dict[str, Any]:  # fmt: skip
    """Generation against its bounds (generation_bounds.py), and the `--sweep` of rollout batch sizes."""
    ppo = config.ppo
    dtype = DTYPES[ppo.rollout.dtype if ppo.rollout.engine == "lean" else config.model.dtype]
    bandwidth, gflops = memory_bandwidth_gbs(), matmul_gflops(dtype, SQUARE, torch.get_num_threads())
    length, prompt_length = ppo.rollout.max_new_tokens, ppo.max_prompt_tokens

    def bound(batch: int) -> Any:
        return generation_bound(trainer.models.policy, dtype, batch, prompt_length, length, bandwidth, gflops)

    times = measurement.iterations
    generate_s = sum(t.generate_s for t in times) / len(times)
    total_s = sum(t.total_s for t in times) / len(times)
    batch = ppo.rollout_batch_size
    return {
        "engine": ppo.rollout.engine,
        "dtype": str(dtype).removeprefix("torch."),
        "share_of_iteration": generate_s / total_s,
        **bound_report(bound(batch), generate_s, batch * length),
        "sweep": batch_sweep(sweep_generation(trainer, prompt_ids, device, length), args.sweep, bound, length),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    allocator_tuned = args.host_allocator == "tuned" and keep_freed_memory()
    device = torch.device(args.device)
    config = resolve_precision(resolve_config(args), device, "benchmark")
    ppo = config.ppo
    tokenizer = load_base_tokenizer(config.model)
    count = ppo.rollout_batch_size * (args.warmup_iterations + args.iterations)
    prompts = benchmark_prompts(tokenizer, args.data, count, ppo.max_prompt_tokens, config.seed)
    prompt_ids = [encode_prompt(tokenizer, prompt.messages, ppo.max_prompt_tokens) for prompt in prompts]
    if any(len(ids) != ppo.max_prompt_tokens for ids in prompt_ids):
        raise ValueError(f"a benchmark prompt is shorter than {ppo.max_prompt_tokens} tokens")
    models, tokenizer = build_models(config, device)
    data = PPOData(
        prompts=[prompt.messages for prompt in prompts],
        val_prompts=[prompts[0].messages, prompts[1].messages],  # the trainer needs 2; validation is not benchmarked
        ptx_examples=[(prompt.messages, prompt.reply) for prompt in prompts],
    )
    trainer = PPOTrainer(models, tokenizer, data, ppo, config.seed, config.distributed.uses_bf16)
    trainer.maker.stop_ids = []  # no stop token: every response is exactly max_new_tokens long (module doc)
    seed_everything(config.seed)
    expected_tokens = ppo.rollout_batch_size * ppo.rollout.max_new_tokens
    measurement = measure(trainer, args.warmup_iterations, args.iterations, device, expected_tokens)
    parameters = sum(p.numel() for p in models.policy.parameters())
    report = throughput_report(
        implementation="rlhf_core",
        settings=benchmark_settings(config, args, models.policy, tokenizer, device, len(prompts), allocator_tuned),
        resolved_config={"ppo": ppo.model_dump(mode="json"), "model": config.model.model_dump(mode="json")},
        workload=Workload(
            batch_size=ppo.rollout_batch_size,
            prompt_length=ppo.max_prompt_tokens,
            response_length=ppo.rollout.max_new_tokens,
            ppo_epochs=ppo.ppo_epochs,
            parameters=parameters,
        ),
        iterations=measurement.iterations,
        wall_s=measurement.wall_s,
        cpu_s=measurement.cpu_s,
        memory=measurement.memory,
        prompt_fingerprint=fingerprint(prompt_ids),
        peak_tflops=args.peak_tflops,
    )
    report["generation"] = generation_section(trainer, config, args, measurement, prompt_ids, device)
    print_report(report)
    print_generation(report["generation"])
    if args.json:
        write_json(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
