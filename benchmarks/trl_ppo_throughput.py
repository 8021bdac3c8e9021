"""Throughput of TRL's PPO trainer (`trl.experimental.ppo.PPOTrainer`, trl 0.29) on the settings of a
`ppo_throughput.py` run, measured the same way (`measurement.py`).

Runs in its own virtual environment (`bash benchmarks/setup_trl_venv.sh`), since TRL pins its own
stack; `compare_trl.py` runs both sides and prints the ratios. Standalone:

    python benchmarks/ppo_throughput.py --config configs/tiny.yaml --json ours.json
    benchmarks/.venv-trl/bin/python benchmarks/trl_ppo_throughput.py --settings ours.json --json trl.json

It reads the `settings` block of our report and mirrors it:

- the same models: the same Llama shape (the tiny model from the same config and seed, so the same
  weights; SmolLM2 from the same safetensors cache). Policy and reference as causal LMs, reward
  and value models as `AutoModelForSequenceClassification` (TRL reads their `.score` head), the
  reference and reward model in the same dtype as ours, and the same `trainable_top_layers` freezing
  of the policy and value model (`freeze_all_but_top_layers`, as in `rlhf_core.models.freezing`);
- the same prompts (`workload.py`; the run fails unless their fingerprint equals ours) and the
  same fixed response length: no stop token (`stop_token=None`, `stop_token_id=None`, so TRL sets the
  policy's generation `eos_token_id` to None), checked on every generated batch;
- the same batch arithmetic: TRL's rollout batch is `per_device_train_batch_size` (our micro-batch
  m) x `gradient_accumulation_steps` (B / m), split into `num_mini_batches` (B / M) mini-batches of M
  rows, each processed in micro-batches of m rows, `num_ppo_epochs` times: the same forward and
  backward passes as ours. One difference is TRL's design: its gradient accumulation spans the
  whole batch, so it takes one optimizer step per epoch where ours takes one per mini-batch (B / M).
  TRL generates and scores `local_rollout_forward_batch_size` rows at a time, set to B (its default,
  64, covers any batch up to 64): one generate call per batch, as ours, and B rows per scoring pass, as
  ours in the benchmark (`ppo.scoring_batch_size`, which ppo_throughput.py sets to B unless told otherwise);
- the same C allocator settings: when ours had glibc keep freed memory (`host_allocator` in its
  settings; rlhf_core/training/host_allocator.py), compare_trl.py starts this script with the same
  settings as glibc's environment variables, and the report says what this process ran with;
- the same PPO constants (temperature, KL coefficient with the k1 estimator, clip ranges, GAE);
  TRL's defaults that would change the work are switched to ours: `gradient_checkpointing=False`,
  `bf16` only with `settings.bf16` (CUDA), no sample generations, no checkpoints, no reporting.

Phases are timed from the outside: wrappers around the functions `PPOTrainer.train` calls
(`batch_generation` -> generate; `forward` and `get_reward` under no_grad -> score) and a
callback at each iteration's end; training runs from the iteration's first forward pass with
gradient to its end; other is the rest (rewards, GAE, TRL's metrics, `gc.collect`).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import transformers
import trl
from datasets import Dataset
from measurement import (
    IterationTimes,
    MemoryWindow,
    Stopwatch,
    Workload,
    peak_memory,
    print_report,
    start_memory_window,
    synchronize,
    throughput_report,
    write_json,
)
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    LlamaConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    TrainerCallback,
)
from transformers.trainer_callback import PrinterCallback
from trl.experimental.ppo import PPOConfig, PPOTrainer
from trl.experimental.ppo import ppo_trainer as trl_ppo_module
from workload import benchmark_prompts, encode_prompt_ids, fingerprint

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# TRL treats every occurrence of the pad id as padding (attention mask = ids != pad). SmolLM2 pads
# with its end-of-turn token, which also closes every turn of a chat prompt, so TRL gets a pad token
# that never occurs in the prompts (the one TRL's examples use for this tokenizer family).
DISTINCT_PAD_TOKEN = "<|endoftext|>"
NO_VALUE_CLIP = 1e9  # TRL always clips the value loss; a huge range when ours does not clip


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--settings", type=Path, required=True, help="a ppo_throughput.py --json report")
    parser.add_argument("--peak-tflops", type=float, help="accelerator peak TFLOP/s, for the MFU figure")
    parser.add_argument("--json", type=Path, help="write every figure to this JSON file")
    return parser.parse_args(argv)


def read_settings(path: Path) -> tuple[dict[str, Any], str]:
    """Our run's `settings` block and prompt fingerprint; refuses what TRL's PPO cannot mirror."""
    report = json.loads(path.read_text(encoding="utf-8"))
    settings = report["settings"]
    if settings["ptx_coef"]:
        raise ValueError(f"{path}: ptx_coef={settings['ptx_coef']}; TRL's PPO has no PPO-ptx term to mirror it")
    if settings["lora"]:
        raise ValueError(f"{path}: LoRA is on; this comparison mirrors full fine-tuning only")
    return settings, report["prompt_fingerprint"]


def load_tokenizer(settings: dict[str, Any]) -> PreTrainedTokenizerBase:
    """The tokenizer our run used, with a pad token that occurs in no prompt (see DISTINCT_PAD_TOKEN)."""
    tokenizer = AutoTokenizer.from_pretrained(settings["tokenizer_path"])
    if DISTINCT_PAD_TOKEN not in tokenizer.get_vocab():
        raise ValueError(f"the tokenizer has no {DISTINCT_PAD_TOKEN} to pad with")
    tokenizer.pad_token = DISTINCT_PAD_TOKEN
    return tokenizer


def freeze_all_but_top_layers(model: PreTrainedModel, n: int | None) -> None:
    """Train only the top `n` blocks, the final norm and the head, as `rlhf_core.models.freezing` does
    (a head tied to the input embedding stays frozen with it)."""
    model.requires_grad_(True)
    if n is None or n == -1:
        return
    prefix = model.base_model_prefix
    backbone = getattr(model, prefix)
    backbone.requires_grad_(False)
    for block in list(backbone.layers)[len(backbone.layers) - n :]:
        block.requires_grad_(True)
    backbone.norm.requires_grad_(True)
    embedding = backbone.get_input_embeddings().weight
    for name, parameter in model.named_parameters():
        if not name.startswith(prefix + ".") and parameter is not embedding:
            parameter.requires_grad_(True)


def build_model(settings: dict[str, Any], scalar_head: bool, dtype: torch.dtype) -> PreTrainedModel:
    """A causal LM, or a sequence classifier with one output (TRL's reward / value model), in eval mode.

    The tiny model is built from our run's config and seed, the way `rlhf_core.models.tiny` builds
    it; a pretrained one is read from our run's weights directory.
    """
    auto = AutoModelForSequenceClassification if scalar_head else AutoModelForCausalLM
    if settings["model_path"] is None:
        config = LlamaConfig.from_dict(settings["model_config"])
        config.num_labels = 1
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(settings["model_seed"])
            model = auto.from_config(config)
        model.to(dtype=dtype)
    else:
        extra = {"num_labels": 1} if scalar_head else {}
        model = auto.from_pretrained(settings["model_path"], dtype=dtype, use_safetensors=True, **extra)
    return model.eval()


def build_models(settings: dict[str, Any]) -> dict[str, PreTrainedModel]:
    """Policy, reference, reward and value models (module doc), on no device yet (TRL places them)."""
    dtype, frozen = DTYPES[settings["dtype"]], DTYPES[settings["frozen_models_dtype"]]
    models = {
        "policy": build_model(settings, scalar_head=False, dtype=dtype),
        "reference": build_model(settings, scalar_head=False, dtype=frozen),
        "reward": build_model(settings, scalar_head=True, dtype=frozen),
        "value": build_model(settings, scalar_head=True, dtype=dtype),
    }
    models["reference"].requires_grad_(False)
    models["reward"].requires_grad_(False)
    freeze_all_but_top_layers(models["policy"], settings["trainable_top_layers"])
    freeze_all_but_top_layers(models["value"], settings["trainable_top_layers"])
    return models


def trl_config(settings: dict[str, Any], output_dir: str) -> PPOConfig:
    """TRL's PPOConfig for our settings (module doc: batch arithmetic and switched defaults)."""
    batch, mini, micro = settings["batch_size"], settings["mini_batch_size"], settings["micro_batch_size"]
    iterations = settings["warmup_iterations"] + settings["iterations"]
    return PPOConfig(
        output_dir=output_dir,
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=batch // micro,  # TRL's rollout batch = micro x accumulation
        num_mini_batches=batch // mini,
        local_rollout_forward_batch_size=batch,
        total_episodes=batch * iterations,
        num_ppo_epochs=settings["ppo_epochs"],
        response_length=settings["response_length"],
        stop_token=None,
        stop_token_id=None,
        missing_eos_penalty=None,
        temperature=settings["temperature"],
        kl_coef=settings["kl_coef"],
        kl_estimator="k1",
        cliprange=settings["clip_eps"],
        cliprange_value=settings["value_clip"] if settings["value_clip"] is not None else NO_VALUE_CLIP,
        gamma=settings["gamma"],
        lam=settings["lam"],
        learning_rate=settings["policy_lr"],
        seed=settings["seed"],
        bf16=settings["bf16"],
        use_cpu=settings["device"] == "cpu",
        gradient_checkpointing=False,
        num_sample_generations=0,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        logging_steps=10**9,
    )


def check_batch_sizes(settings: dict[str, Any], args: PPOConfig) -> None:
    """Fail unless TRL resolved the rollout and mini-batch sizes to ours (it computes them in its
    constructor from the micro-batch, accumulation and mini-batch count)."""
    ours = (settings["batch_size"], settings["mini_batch_size"], settings["micro_batch_size"])
    trl_sizes = (args.batch_size, args.mini_batch_size, args.per_device_train_batch_size)
    if trl_sizes != ours:
        raise ValueError(f"TRL resolved batch / mini / micro sizes {trl_sizes}, ours are {ours}")


class IterationClock(TrainerCallback):
    """Splits TRL's training run into iterations and phases (module doc), measuring after the warm-up.

    `install` wraps the module-level functions of `trl.experimental.ppo.ppo_trainer` that
    `PPOTrainer.train` calls by name; the trainer's iteration ends are this callback's `on_step_end`.
    """

    def __init__(self, device: torch.device, warmup: int, prompt_length: int, response_length: int) -> None:
        self.device = device
        self.warmup = warmup
        self.expected_width = prompt_length + response_length
        self.stopwatch = Stopwatch(device)
        self.iteration_started = 0.0
        self.training_started: float | None = None
        self.measurement_started = self.measurement_ended = 0.0
        self.cpu_started = self.cpu_ended = 0.0
        self.memory_window: MemoryWindow | None = None
        self.iterations: list[IterationTimes] = []

    def install(self) -> None:
        generate = self.stopwatch.timed("generate", trl_ppo_module.batch_generation)
        trl_ppo_module.batch_generation = self._checked_generation(generate)
        trl_ppo_module.forward = self._scoring_or_training(trl_ppo_module.forward)
        trl_ppo_module.get_reward = self._scoring_or_training(trl_ppo_module.get_reward)

    def _checked_generation(self, generate: Any) -> Any:
        """Generation that fails unless every response is exactly the fixed length."""

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            query_responses, logits = generate(*args, **kwargs)
            if query_responses.shape[1] != self.expected_width:
                raise RuntimeError(
                    f"TRL generated {query_responses.shape[1]} prompt + response columns, expected "
                    f"{self.expected_width}: generation stopped early"
                )
            return query_responses, logits

        return wrapper

    def _scoring_or_training(self, function: Any) -> Any:
        """No-grad calls are scoring; the first call with gradient starts the training phase."""
        timed = self.stopwatch.timed("score", function)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():
                return timed(*args, **kwargs)
            if self.training_started is None:
                synchronize(self.device)
                self.training_started = time.perf_counter()
            return function(*args, **kwargs)

        return wrapper

    def _start_measurement(self) -> None:
        synchronize(self.device)
        self.memory_window = start_memory_window(self.device)
        self.measurement_started = self.iteration_started = time.perf_counter()
        self.cpu_started = time.process_time()

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.iteration_started = time.perf_counter()
        if self.warmup == 0:
            self._start_measurement()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        synchronize(self.device)
        ended = time.perf_counter()
        phases = self.stopwatch.take()
        if self.training_started is None:
            raise RuntimeError(f"TRL iteration {state.global_step} ran no training forward pass")
        training = ended - self.training_started
        self.training_started = None
        if state.global_step <= self.warmup:
            if state.global_step == self.warmup:
                self._start_measurement()
            else:
                self.iteration_started = ended
            return
        generate, score = phases.get("generate", 0.0), phases.get("score", 0.0)
        total = ended - self.iteration_started
        self.iterations.append(
            IterationTimes(
                generate_s=generate, score_s=score, train_s=training, other_s=total - generate - score - training
            )
        )
        self.iteration_started = self.measurement_ended = ended
        self.cpu_ended = time.process_time()


def glibc_allocator_environment() -> dict[str, str] | str:
    """glibc's malloc variables this process was started with, or "default"."""
    names = ("MALLOC_MMAP_MAX_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
    return {name: os.environ[name] for name in names if name in os.environ} or "default"


def trl_settings(settings: dict[str, Any], args: PPOConfig, tokenizer: PreTrainedTokenizerBase) -> dict[str, Any]:
    """Our settings as TRL resolved them (read back from its config after the trainer computed its
    batch sizes), so the side-by-side table shows what each side actually ran."""
    return {
        **settings,
        "torch_threads": torch.get_num_threads(),
        "host_allocator": glibc_allocator_environment(),
        "batch_size": args.batch_size,
        "mini_batch_size": args.mini_batch_size,
        "micro_batch_size": args.per_device_train_batch_size,
        "scoring_batch_size": args.local_rollout_forward_batch_size,
        "response_length": args.response_length,
        "ppo_epochs": args.num_ppo_epochs,
        "temperature": args.temperature,
        "kl_coef": args.kl_coef,
        "clip_eps": args.cliprange,
        "value_clip": args.cliprange_value,
        "gamma": args.gamma,
        "lam": args.lam,
        "policy_lr": args.learning_rate,
        "critic_lr": args.learning_rate,  # one optimizer, one learning rate for policy and value model
        "max_grad_norm": None,  # PPOTrainer.train never clips gradients
        "bf16": args.bf16,
        "ptx_coef": 0.0,
        "stop_token": args.stop_token_id,
        "pad_token": tokenizer.pad_token,
    }


TRL_CONFIG_KEYS = (
    "batch_size", "mini_batch_size", "local_mini_batch_size", "per_device_train_batch_size",
    "gradient_accumulation_steps", "num_mini_batches", "local_rollout_forward_batch_size",
    "num_ppo_epochs", "total_episodes", "num_total_batches", "response_length", "stop_token",
    "stop_token_id", "missing_eos_penalty", "temperature", "kl_coef", "kl_estimator", "whiten_rewards",
    "cliprange", "cliprange_value", "vf_coef", "gamma", "lam", "learning_rate", "lr_scheduler_type",
    "optim", "max_grad_norm", "bf16", "gradient_checkpointing", "seed",
)  # fmt: skip


def _json_value(value: Any) -> Any:
    """Numbers, booleans and None as they are; anything else (enums) as its string."""
    return value if isinstance(value, (int, float, bool, type(None))) else str(value)


def checked_prompt_ids(
    tokenizer: PreTrainedTokenizerBase, settings: dict[str, Any], our_fingerprint: str
) -> list[list[int]]:
    """The benchmark prompts' token ids, refused unless they are our run's (same fingerprint) and free of
    the pad token, which TRL would mask."""
    length = settings["prompt_length"]
    prompts = benchmark_prompts(tokenizer, settings["data"], settings["prompt_count"], length, settings["seed"])
    prompt_ids = [encode_prompt_ids(tokenizer, prompt.messages, length) for prompt in prompts]
    if fingerprint(prompt_ids) != our_fingerprint:
        raise ValueError("the prompts differ from our run's (fingerprint mismatch): not a like-for-like comparison")
    if any(tokenizer.pad_token_id in ids for ids in prompt_ids):
        raise ValueError(f"a prompt contains the pad token {tokenizer.pad_token}, which TRL would mask")
    return prompt_ids


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    transformers.logging.set_verbosity_error()
    logging.getLogger("trl").setLevel(logging.ERROR)
    settings, our_fingerprint = read_settings(args.settings)
    torch.set_num_threads(settings["torch_threads"])
    device = torch.device(settings["device"])
    tokenizer = load_tokenizer(settings)
    length = settings["prompt_length"]
    prompt_ids = checked_prompt_ids(tokenizer, settings, our_fingerprint)
    models = build_models(settings)
    clock = IterationClock(device, settings["warmup_iterations"], length, settings["response_length"])
    clock.install()
    dataset = Dataset.from_dict({"input_ids": prompt_ids})
    with tempfile.TemporaryDirectory(prefix="trl-ppo-benchmark-") as output_dir:
        trainer = PPOTrainer(
            args=trl_config(settings, output_dir),
            processing_class=tokenizer,
            model=models["policy"],
            ref_model=models["reference"],
            reward_model=models["reward"],
            value_model=models["value"],
            train_dataset=dataset,
            eval_dataset=dataset.select(range(settings["batch_size"])),
            callbacks=[clock],
        )
        check_batch_sizes(settings, trainer.args)
        trainer.remove_callback(PrinterCallback)  # it would print TRL's metrics every iteration
        trainer.train()
    if len(clock.iterations) != settings["iterations"] or clock.memory_window is None:
        raise RuntimeError(f"measured {len(clock.iterations)} TRL iterations, expected {settings['iterations']}")
    resolved = {key: _json_value(getattr(trainer.args, key)) for key in TRL_CONFIG_KEYS}
    report = throughput_report(
        implementation=f"trl {trl.__version__}",
        settings=trl_settings(settings, trainer.args, tokenizer),
        resolved_config={"trl.experimental.ppo.PPOConfig": resolved},
        workload=Workload(
            batch_size=trainer.args.batch_size,
            prompt_length=length,
            response_length=trainer.args.response_length,
            ppo_epochs=trainer.args.num_ppo_epochs,
            parameters=sum(p.numel() for p in models["policy"].parameters()),
        ),
        iterations=clock.iterations,
        wall_s=clock.measurement_ended - clock.measurement_started,
        cpu_s=clock.cpu_ended - clock.cpu_started,
        memory=peak_memory(device, clock.memory_window),
        prompt_fingerprint=fingerprint(prompt_ids),
        peak_tflops=args.peak_tflops,
    )
    print_report(report)
    if args.json:
        write_json(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
