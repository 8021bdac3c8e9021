"""Stage `ppo`: PPO-max (paper section 5) from the SFT and reward-model outputs.

Inputs: `data_dir` (the prepared splits: `ppo_prompts` to train on, `ppo_val_prompts` to validate
and select the output on (held out of training and disjoint from `eval`), `sft` for PPO-ptx), `sft_dir/model` (the
policy and its frozen reference copy) and `rm_dir/model`
(the frozen reward model, and the critic's initialisation when `ppo.critic_init` is "reward").

Outputs in `out_dir`:

    model/            the selected validated policy (rlhf_core/ppo/selection.py: the latest within the KL
                      bound unless an earlier one is better by two paired standard errors), in
                      Hugging Face format with chat template and an end-of-turn generation config;
                      when the selection hands on the start (step 0), a copy of the SFT model's files,
                      so it hashes as the SFT model does
    metrics.json      headline figures, written LAST: the stage is complete iff it exists
    history.jsonl     every monitor, one line per iteration; step 0 validates the SFT policy
    samples.jsonl     sample prompts and responses every `ppo.sample_table_every` iterations
    plots/*.png       the paper's Figure 4 panels (reward, KL, perplexity, response length) and
                      validation_gain.png (each validated policy's paired gain with its 95% interval)
    checkpoints/      step-*/ (the newest `ppo.keep_checkpoints`) for exact resume, and best/
    selection.json    the selection: chosen step, rule, the paired gain over the SFT policy with its 95%
                      interval, and every validation's per-prompt rewards
    guard_stop.txt    only when the collapse guard stopped the run: its message
    reward_model.json the reward model PPO optimised against: its path and content sha256, so an
                      evaluation can tell whether its reward-model judge is in-sample (`reward_record`)

Under the deepspeed launcher (`distributed.num_processes > 1`) every rank runs `run_ppo`; the batch
settings are per rank (rlhf_core/ppo/trainer.py) and only rank 0 writes the outputs above.

Rerunning with the same `out_dir` resumes from the newest checkpoint when the settings, the seed, the
data and the SFT and reward models (by content hash) are those `checkpoints/run_inputs.json` records;
otherwise it refuses before touching the output, naming what differs. A run stopped by the collapse
guard is still a completed stage: its output is the best policy validated before the stop.
"""

from __future__ import annotations

import json
import math
import shutil
import statistics
import time
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from rlhf_core.atomic import atomic_directory, atomic_write_text
from rlhf_core.config import CollapseGuardConfig, Config
from rlhf_core.data.prepare import load_split
from rlhf_core.distributed.collectives import computed_on_main
from rlhf_core.distributed.context import stage_context
from rlhf_core.layout import (
    CHECKPOINTS_DIR,
    DATA_REPORT_FILE,
    HISTORY_FILE,
    METRICS_FILE,
    MODEL_DIR,
    PLOTS_DIR,
    SAMPLES_FILE,
    SELECTION_FILE,
)
from rlhf_core.models.base import DTYPES
from rlhf_core.models.chat import end_of_turn_id
from rlhf_core.models.heads import RewardModel
from rlhf_core.models.loading import load_causal_lm, load_tokenizer
from rlhf_core.ppo.critic import load_critic
from rlhf_core.ppo.experience_maker import PPOModels
from rlhf_core.ppo.monitors import SampleTable
from rlhf_core.ppo.plots import plot_figure_4, plot_validation_gain
from rlhf_core.ppo.scoring import RewardModelScorer
from rlhf_core.ppo.trainer import FitResult, PPOData, PPOTrainer, fit
from rlhf_core.ppo.validation import BEST_DIR, VALIDATED_DIR, validated_dir
from rlhf_core.stages.precision import precision_record, resolve_precision
from rlhf_core.stages.result import StageResult, read_metrics, write_metrics
from rlhf_core.stages.training_run import (
    RunInputs,
    check_resumable,
    file_sha256,
    model_dir_sha256,
    record_run_inputs,
    stage_lock,
    stage_settings,
    training_device,
)
from rlhf_core.training.logger import JsonlLogger, MetricsLogger, MultiLogger

GUARD_STOP_FILE = "guard_stop.txt"
SELECTION_RULE = (
    "the latest validated policy within the KL bound (ppo.guard.max_kl), unless an earlier one is better by "
    "more than 2 paired standard errors of the per-prompt reward on the held-out PPO validation prompts"
)
REWARD_RECORD_FILE = "reward_model.json"
REWARD_MODEL_INPUT = "reward model"  # the reward model's name among a run's inputs (run_inputs.json)
HEADLINE_MONITORS = ("reward/score_mean", "kl/token_k3", "perplexity/policy", "response/length_mean")


def load_ppo_models(
    config: Config, sft_dir: Path, rm_dir: Path, device: torch.device
) -> tuple[PPOModels, PreTrainedTokenizerBase]:
    """Policy and frozen reference from the SFT model, frozen reward model, critic per `critic_init`
    (rlhf_core/ppo/critic.py).

    The two frozen models are loaded in `ppo.frozen_models_dtype` (bf16 halves their memory; they only
    run forward passes, whose log-probs and scores are upcast to fp32), the trained ones in `model.dtype`.
    Refuses a reward model whose tokenizer differs from the policy's: it would score other text
    than the policy wrote.
    """
    read_metrics(sft_dir)  # raises unless the SFT stage completed
    read_metrics(rm_dir)
    dtype = DTYPES[config.model.dtype]
    frozen_dtype = DTYPES[config.ppo.frozen_models_dtype or config.model.dtype]
    policy, tokenizer = load_causal_lm(sft_dir / MODEL_DIR, dtype=dtype, device=device)
    reference, _ = load_causal_lm(sft_dir / MODEL_DIR, dtype=frozen_dtype, device=device)
    reward_model = RewardModel.from_pretrained(rm_dir / MODEL_DIR, dtype=frozen_dtype, device=device)
    reward_model.requires_grad_(False)
    if load_tokenizer(rm_dir / MODEL_DIR).get_vocab() != tokenizer.get_vocab():
        raise ValueError(f"the reward model in {rm_dir} uses another tokenizer than the SFT model in {sft_dir}")
    if reward_model.eot_id != end_of_turn_id(tokenizer):
        raise ValueError(
            f"the reward model reads its score at token id {reward_model.eot_id}, but the policy ends its "
            f"turns with token id {end_of_turn_id(tokenizer)}"
        )
    critic = load_critic(config.ppo.critic_init, sft_dir / MODEL_DIR, rm_dir / MODEL_DIR, dtype, device, config.seed)
    scorer = RewardModelScorer(reward_model, config.ppo.scoring_rows)
    return PPOModels(policy=policy, reference=reference, critic=critic, scorer=scorer), tokenizer


def load_ppo_data(config: Config, data_dir: Path) -> PPOData:
    """Training prompts, the held-out PPO validation prompts and, for PPO-ptx, the SFT pairs."""
    ptx = [(example.prompt, example.response) for example in load_split(data_dir, "sft")] if config.ppo.ptx_coef else []
    validation = load_split(data_dir, "ppo_val_prompts")
    return PPOData(
        prompts=[prompt.prompt for prompt in load_split(data_dir, "ppo_prompts")],
        val_prompts=[prompt.prompt for prompt in validation],
        ptx_examples=ptx,
        val_prompt_ids=[prompt.prompt_id for prompt in validation],
    )


def read_history(path: Path) -> list[dict[str, float]]:
    """The rows of history.jsonl."""
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def stage_metrics(
    result: FitResult, history: list[dict[str, float]], wall_time: float, guard: CollapseGuardConfig
) -> dict[str, float]:
    """The headline figures of metrics.json: the selected policy vs the SFT policy (paired, with its 95%
    interval), how the run ended (`guard_enabled`: whether the collapse guard had a bound to stop it by,
    so that `guard_stopped` 0 of a run without one is not read as "no collapse"; and each bound on or off,
    `CollapseGuardConfig.bounds_on`), the critic before the
    policy moved, the first and last values of the Figure-4 monitors, and how the reward ranked the SFT
    policy's replies by length (`sft_reward_length_spearman`)."""
    selected = result.selection
    chosen_row = next(row for row in history if row["step"] == selected.step and "val/reward" in row)
    initial_row = next(row for row in history if row["step"] == 0 and "val/reward" in row)
    gain = selected.versus_initial
    metrics = {
        "steps_completed": float(result.final_step),
        "total_steps": float(result.total_steps),
        "critic_pretrain_steps": float(result.critic_pretrain_steps),
        "best_step": float(selected.step),
        "val/reward_best": chosen_row["val/reward"],
        "val/kl_best": chosen_row["val/kl"],
        "val/reward_initial": initial_row["val/reward"],
        "val/reward_gain": gain.mean,
        "val/reward_gain_low": gain.low,
        "val/reward_gain_high": gain.high,
        "val/prompts": float(gain.prompts),
        "guard_enabled": float(guard.enabled),
        **{name: float(on) for name, on in guard.bounds_on().items()},
        "guard_stopped": float(result.stop is not None),
        "resumed_from": float(result.resumed_from),  # the restored checkpoint's iteration (0: fresh start)
        "wall_time_s": wall_time,  # of this invocation (a resumed run counts only its own part)
    }
    if result.stop is not None:
        metrics["guard_stop_step"] = float(result.stop.step)
    critic_rows = [row for row in history if row["step"] > 0 and "values/explained_variance" in row]
    if critic_rows:  # the critic before pretraining, and as the policy starts to move
        metrics["critic/explained_variance_initial"] = critic_rows[0]["values/explained_variance"]
        started = [row for row in critic_rows if row["step"] > result.critic_pretrain_steps]
        if started:
            metrics["critic/explained_variance_pretrained"] = started[0]["values/explained_variance"]
    if "reward/length_residual_slope" in initial_row:  # length_residual: initial, the slope taken from every score
        metrics["length_residual_slope"] = initial_row["reward/length_residual_slope"]
    metrics.update(sft_reward_length_spearman(history, result.critic_pretrain_steps))
    trained = [row for row in history if row["step"] > 0]
    for name in HEADLINE_MONITORS:
        values = [row[name] for row in trained if name in row]
        if values:
            metrics[f"first/{name}"] = values[0]
            metrics[f"last/{name}"] = values[-1]
    return metrics


def sft_reward_length_spearman(history: list[dict[str, float]], critic_pretrain_steps: int) -> dict[str, float]:
    """How the reward ranks the SFT policy's own replies by length: the mean of `reward/length_spearman`
    over the rollouts sampled before the policy's first update (iterations 1 to critic_pretrain_steps + 1,
    read from history.jsonl, so it survives resumes), with its standard error and their number. One
    rollout of 16 replies alone is too noisy to compare reward models by (docs/stages-ppo.md)."""
    values = [
        row["reward/length_spearman"]
        for row in history
        if 1 <= row["step"] <= critic_pretrain_steps + 1 and "reward/length_spearman" in row
    ]
    if not values:
        return {}
    figures = {
        "reward_length_spearman_sft": statistics.fmean(values),
        "reward_length_spearman_sft_rollouts": float(len(values)),
    }
    if len(values) > 1:
        figures["reward_length_spearman_sft_se"] = statistics.stdev(values) / math.sqrt(len(values))
    return figures


def selection_record(result: FitResult, prompt_ids: list[str]) -> dict[str, object]:
    """selection.json: the rule's decision, the prompts validated on, and the per-prompt rewards (in the
    order of `prompt_ids`) it was made from."""
    gain = result.selection.versus_initial
    return {
        "chosen_step": result.selection.step,
        "rule": SELECTION_RULE,
        "reason": result.selection.reason,
        "gain_over_initial": {
            "mean": gain.mean,
            "standard_error": gain.standard_error,
            "low": gain.low,
            "high": gain.high,
            "prompts": gain.prompts,
        },
        "prompt_ids": prompt_ids,
        "validations": [record.to_dict() for record in result.validations],
    }


def copy_best_policy(checkpoint_dir: Path, model_dir: Path, chosen_step: int, sft_model_dir: Path) -> None:
    """Install the chosen policy as the stage's `model/`, atomically: `checkpoints/best/`, or, when the
    selection handed on the start (step 0), the SFT model's own files. The start is the SFT model, and its
    bytes (not a re-save, whose dtype or file layout may differ) make `model/` hash as the SFT model does,
    which is how the pipeline knows not to evaluate the two against each other (flows/pipeline.py)."""
    best = sft_model_dir if chosen_step == 0 else checkpoint_dir / BEST_DIR
    if not best.is_dir():
        raise FileNotFoundError(f"{best} is missing: the run has no validated policy to hand on")
    with atomic_directory(model_dir) as temporary:
        shutil.copytree(best, temporary, dirs_exist_ok=True)


def prune_validated(checkpoint_dir: Path, chosen_step: int) -> None:
    """Delete the validated policies the selection did not choose (a rerun's selection finds the chosen one)."""
    for path in (checkpoint_dir / VALIDATED_DIR).glob("step-*"):
        if path != validated_dir(checkpoint_dir, chosen_step):
            shutil.rmtree(path)


def _clear_completion_markers(out_dir: Path) -> None:
    """A rerun is not complete until it writes metrics.json again; a stale guard message goes too."""
    for name in (METRICS_FILE, GUARD_STOP_FILE):
        (out_dir / name).unlink(missing_ok=True)


def ppo_run_inputs(config: Config, data_dir: Path, sft_dir: Path, rm_dir: Path) -> RunInputs:
    """What a PPO run depends on, checked before it resumes checkpoints (`check_resumable`): the ppo
    and model settings, the seed, the prepared data, and the SFT and reward models by content hash."""
    return RunInputs(
        stage_settings(config, "ppo"),
        {
            "data": file_sha256(data_dir / DATA_REPORT_FILE),
            "SFT model": model_dir_sha256(sft_dir / MODEL_DIR),
            REWARD_MODEL_INPUT: model_dir_sha256(rm_dir / MODEL_DIR),
        },
    )


def run_ppo(
    config: Config, data_dir: Path, sft_dir: Path, rm_dir: Path, out_dir: Path, logger: MetricsLogger | None = None
) -> StageResult:
    """Train the policy with PPO-max (resuming from `out_dir/checkpoints` if possible); see module doc.

    Holds the output lock for the whole stage (rlhf_core/output_lock.py).
    """
    started = time.perf_counter()
    data_dir, sft_dir, rm_dir, out_dir = Path(data_dir), Path(sft_dir), Path(rm_dir), Path(out_dir)
    resolved = resolve_precision(config, training_device(), "ppo")
    with stage_lock(out_dir, "ppo"):
        trainer, inputs = _prepare_run(resolved, data_dir, sft_dir, rm_dir, out_dir)
        if not trainer.context.is_main:  # the other ranks train alongside, write nothing
            result = fit(trainer, out_dir / CHECKPOINTS_DIR)
            return StageResult(out_dir=out_dir, metrics=result.metrics, model_dir=out_dir / MODEL_DIR)
        result = _fit_logged(trainer, config, precision_record(resolved), out_dir, logger)
        write_reward_record(out_dir, rm_dir, inputs.inputs[REWARD_MODEL_INPUT])  # hashed once, with the inputs
        return _write_outputs(result, trainer, sft_dir, out_dir, time.perf_counter() - started)


def _prepare_run(
    config: Config, data_dir: Path, sft_dir: Path, rm_dir: Path, out_dir: Path
) -> tuple[PPOTrainer, RunInputs]:
    """The trainer and the run's inputs, once the checkpoints are known to belong to them (a refusal touches
    nothing)."""
    context = stage_context(config.distributed)  # the process group before any engine can start its own
    device = training_device()
    models, tokenizer = load_ppo_models(config, sft_dir, rm_dir, device)
    trainer = PPOTrainer(
        models,
        tokenizer,
        load_ppo_data(config, data_dir),
        config.ppo,
        config.seed,
        config.distributed.uses_bf16,
        config.distributed,
    )
    inputs = computed_on_main(lambda: ppo_run_inputs(config, data_dir, sft_dir, rm_dir))  # hashed once, not per rank
    check_resumable(out_dir / CHECKPOINTS_DIR, inputs)
    out_dir.mkdir(parents=True, exist_ok=True)
    _clear_completion_markers(out_dir)
    if context.is_main:
        record_run_inputs(out_dir / CHECKPOINTS_DIR, inputs)
    return trainer, inputs


def _fit_logged(
    trainer: PPOTrainer, config: Config, precision: dict[str, str], out_dir: Path, logger: MetricsLogger | None
) -> FitResult:
    """`fit` with history.jsonl, samples.jsonl and the caller's logger (MLflow when orchestrated), which
    get `config`'s settings as asked and the `precision` they resolved to."""
    history = JsonlLogger(out_dir / HISTORY_FILE)
    samples = SampleTable(out_dir / SAMPLES_FILE)
    run_logger = MultiLogger([history, logger]) if logger is not None else history
    guard = config.ppo.guard.describe()  # each bound, on or off
    params = {"ppo": config.ppo.model_dump(mode="json"), "seed": config.seed, "guard": guard}
    run_logger.log_params({**params, "precision": precision})
    try:
        return fit(trainer, out_dir / CHECKPOINTS_DIR, run_logger, samples, progress_bar=True)
    finally:
        history.close()
        samples.close()


def _write_outputs(result: FitResult, trainer: PPOTrainer, sft_dir: Path, out_dir: Path, seconds: float) -> StageResult:
    """The selected policy as `model/`, selection.json, the plots, and metrics.json last (completion)."""
    if result.stop is not None:
        (out_dir / GUARD_STOP_FILE).write_text(str(result.stop) + "\n", encoding="utf-8")
    copy_best_policy(out_dir / CHECKPOINTS_DIR, out_dir / MODEL_DIR, result.selection.step, sft_dir / MODEL_DIR)
    prune_validated(out_dir / CHECKPOINTS_DIR, result.selection.step)
    selection = selection_record(result, trainer.validator.prompt_names)
    atomic_write_text(out_dir / SELECTION_FILE, json.dumps(selection, indent=2) + "\n")
    rows = read_history(out_dir / HISTORY_FILE)
    plot_figure_4(rows, out_dir / PLOTS_DIR)
    plot_validation_gain(result.validations, result.selection.step, out_dir / PLOTS_DIR / "validation_gain.png")
    metrics = stage_metrics(result, rows, seconds, trainer.guard.bounds)
    write_metrics(out_dir, metrics)
    return StageResult(out_dir=out_dir, metrics=metrics, model_dir=out_dir / MODEL_DIR)


def guard_message(out_dir: Path) -> str | None:
    """The collapse guard's message of a completed run it stopped, else None."""
    path = Path(out_dir) / GUARD_STOP_FILE
    return path.read_text(encoding="utf-8").strip() if path.is_file() else None


def write_reward_record(out_dir: Path, rm_dir: Path, rm_sha256: str) -> None:
    """`out_dir/reward_model.json`: which reward model (`rm_dir`, whose model's content hash is `rm_sha256`)
    this policy was optimised against; `reward_record` reads it."""
    record = {"path": str(Path(rm_dir).resolve()), "sha256": rm_sha256}
    atomic_write_text(Path(out_dir) / REWARD_RECORD_FILE, json.dumps(record, indent=2) + "\n")


def reward_record(policy_dir: Path) -> dict[str, str] | None:
    """The reward-model record (`path`, `sha256`) next to a policy (a PPO output, or a policy directory
    that carries one), or None when the policy does not say which reward model trained it."""
    path = Path(policy_dir) / REWARD_RECORD_FILE
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None
