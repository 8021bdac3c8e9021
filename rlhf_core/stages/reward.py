"""Stage `train-rm`: the reward model of paper section 4.2 (`score-pairs` checks one: stages/score_pairs.py).

The backbone starts from the SFT stage's model/ (`reward.init_from: sft`) or the base model (`base`); a
fresh scalar head reads the final hidden state at the reply's end-of-turn token. Loss, eq. (2): the
ranking loss -log sigmoid(r_chosen - r_rejected) averaged over pairs, plus `beta_rm` times the LM loss on
the chosen reply averaged over its tokens. Batches hold a fixed number of pairs or, with
`reward.batching: token_budget`, as many as fit a padded-token budget (the paper's dynamic batching).
The learning rate warms up over the first `warmup_ratio` of the steps and then stays constant.

With `trainable_top_layers` set, the frozen lower blocks' output is computed once per sequence and
reused by every later epoch and validation (`reward.cache_frozen_layers`, rlhf_core.reward.frozen_cache).

The output model is the checkpoint with the best validation accuracy: every improvement is saved to
model/ (loadable with `RewardModel.from_pretrained`, as PPO does). At the end that model is scored on
every validation pair for metrics.json (accuracy with its 95% Wilson interval, mean margin, losses, and
its skill beyond reply length: rlhf_core/reward/length_metrics.py, docs/stages-sft-rm.md),
plots/reward_margin_hist.png (the paper's Figure 2) and validation_pairs.jsonl (each pair with both
scores, rlhf_core/reward/validation_table.py); training_data.json records the splits it was
trained and validated on and the model it started from (rlhf_core/reward/training_data.py). The same
function trains the independent judge reward model on the PPO-prompt split (stages/judge_reward.py).

Under the deepspeed launcher (`distributed.num_processes > 1`) every rank runs `run_train_rm` on its
shard of every step's pairs (the batch settings are per rank); only rank 0 saves model/, writes the
history, scores the best model and writes metrics.json.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from rlhf_core.config import Config, RewardConfig
from rlhf_core.data.prepare import load_split
from rlhf_core.data.records import PreferencePair
from rlhf_core.distributed.context import stage_context
from rlhf_core.layout import CHECKPOINTS_DIR, DATA_REPORT_FILE, MODEL_DIR, PLOTS_DIR
from rlhf_core.models.base import DTYPES, load_base_model
from rlhf_core.models.chat import end_of_turn_id
from rlhf_core.models.freezing import enable_gradient_checkpointing
from rlhf_core.models.heads import RewardModel
from rlhf_core.models.loading import load_causal_lm
from rlhf_core.models.lora import make_trainable
from rlhf_core.reward.batch import (
    EncodedPairs,
    PairBatch,
    collate_pairs,
    encode_pairs,
    padded_pair_length,
    pair_reply_tokens,
)
from rlhf_core.reward.frozen_cache import FrozenLowerCache
from rlhf_core.reward.length_debias import length_balanced_pairs, logit_scores, new_length_head, odin_penalty
from rlhf_core.reward.length_metrics import AUC_GAIN_RESAMPLES
from rlhf_core.reward.loss import ranking_loss_sum, reward_model_loss
from rlhf_core.reward.plots import plot_margin_histogram
from rlhf_core.reward.scoring import pair_outputs, score_pair_batches
from rlhf_core.reward.training_data import TrainSplit, training_data_record, write_training_data
from rlhf_core.reward.validation_metrics import validation_metrics
from rlhf_core.reward.validation_table import validation_pair_rows, write_validation_pairs
from rlhf_core.sft.batch import evaluation_chunks
from rlhf_core.sft.loss import count_target_tokens
from rlhf_core.stages.precision import precision_record, resolve_precision
from rlhf_core.stages.result import StageResult, read_metrics, write_metrics
from rlhf_core.stages.training_run import (
    RunInputs,
    RunState,
    check_resumable,
    file_sha256,
    loop_config,
    loop_logger,
    mark_incomplete,
    model_dir_sha256,
    record_run_inputs,
    stage_lock,
    stage_settings,
    training_device,
)
from rlhf_core.statistics import length_slope
from rlhf_core.training.batching import BatchPlan, batch_plan
from rlhf_core.training.logger import MetricsLogger
from rlhf_core.training.loop import TrainResult, total_steps, train
from rlhf_core.training.precision import autocast

MARGIN_PLOT = Path(PLOTS_DIR) / "reward_margin_hist.png"
Metrics = dict[str, float]


# --------------------------------------------------------------------------------------------------
# building blocks


def initial_language_model(
    config: Config, sft_dir: Path | None, device: torch.device
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, dict[str, str]]:
    """The causal LM the reward model starts from, its tokenizer, and the sha256 that identifies it
    (the content hash of the SFT model directory, as PPO identifies its input models; the base model
    is identified by the `model` settings)."""
    if config.reward.init_from == "base":
        model, tokenizer = load_base_model(config.model, device)
        return model, tokenizer, {}
    if sft_dir is None:
        raise ValueError("reward.init_from is 'sft' but no SFT output directory was given")
    read_metrics(sft_dir)  # refuses an SFT output that has not finished
    model, tokenizer = load_causal_lm(sft_dir / MODEL_DIR, dtype=DTYPES[config.model.dtype], device=device)
    return model, tokenizer, {"SFT model": model_dir_sha256(sft_dir / MODEL_DIR)}


def initial_reward_model(
    config: Config, sft_dir: Path | None, device: torch.device
) -> tuple[RewardModel, PreTrainedTokenizerBase, dict[str, str]]:
    """The initial LM's backbone with a fresh scalar head (and its LM head when beta_rm > 0), frozen below
    the top `trainable_top_layers` blocks (or, with `reward.lora`, frozen but for adapters in those blocks
    and the scalar head); its tokenizer; the hashes identifying the initial LM."""
    settings = config.reward
    lm, tokenizer, init_hashes = initial_language_model(config, sft_dir, device)
    model = RewardModel.from_causal_lm(
        lm, end_of_turn_id(tokenizer), keep_lm_head=settings.beta_rm > 0, seed=config.seed
    ).to(device)
    dtype = model.score_head.weight.dtype
    model.length_head = new_length_head(
        settings.length_debias, model.score_head.in_features, config.seed, dtype, device
    )
    heads = [model.score_head] + ([model.length_head] if model.length_head is not None else [])
    make_trainable(model, settings.trainable_top_layers, settings.lora, config.seed, heads=heads)
    if settings.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    return model, tokenizer, init_hashes


def frozen_layer_cache(model: RewardModel, settings: RewardConfig) -> FrozenLowerCache | None:
    """A cache of the frozen lower blocks' output, when some blocks are frozen and caching is on."""
    if settings.trainable_top_layers is None or not settings.cache_frozen_layers:
        return None
    num_lower = model.backbone.config.num_hidden_layers - settings.trainable_top_layers
    return FrozenLowerCache(num_lower) if num_lower > 0 else None


def pair_batch_plan(pairs: EncodedPairs, settings: RewardConfig, seed: int, world_size: int = 1) -> BatchPlan:
    """The micro-batches of pairs `settings.batching` names, a pair's length being `padded_pair_length`.

    The plan is the global batch: `grad_accum_steps` micro-batches per rank, for `world_size` ranks.
    """
    return batch_plan(
        settings.batching,
        [padded_pair_length(pair) for pair in pairs.pairs],
        seed,
        micro_batch_size=settings.micro_batch_size,
        token_budget=settings.token_budget,
        accumulation_steps=settings.grad_accum_steps * world_size,
    )


def validation_batches(pairs: EncodedPairs, batch_size: int, seed: int, pad_id: int) -> list[PairBatch]:
    """Validation pairs as batches in a fixed seeded order (periodic validations use the first few)."""
    return [
        collate_pairs([pairs.pairs[i] for i in chunk], chunk, pad_id)
        for chunk in evaluation_chunks(len(pairs.pairs), batch_size, seed)
    ]


def scored_reply_tokens(pairs: EncodedPairs, batches: list[PairBatch]) -> tuple[np.ndarray, np.ndarray]:
    """The chosen and rejected reply lengths ([P] each) of the pairs of `batches`, in the order they are scored."""
    return pair_reply_tokens([pairs.pairs[position] for batch in batches for position in batch.indices])


def count_pairs_and_tokens(batch: PairBatch) -> dict[str, int]:
    """The units eq. (2) averages over: pairs (ranking term) and chosen reply tokens (LM term)."""
    return {"pairs": len(batch.indices), "tokens": count_target_tokens(batch.chosen.labels)}


def reward_loss_fn(
    cache: FrozenLowerCache | None, settings: RewardConfig
) -> Callable[[nn.Module, PairBatch, dict[str, int]], tuple[Tensor, Metrics]]:
    """The loop's loss_fn: eq. (2) for a micro-batch, normalised by the optimizer step's totals.

    With a length head (`reward.length_debias`: length_term, odin) the ranking term compares r + r_L;
    odin adds its penalties, weighted by the micro-batch's share of the step's pairs so a step's
    penalty is the mean over its micro-batches whatever their split. Accuracy and margin are of r alone.
    """
    beta_rm = settings.beta_rm

    def loss_fn(model: nn.Module, batch: PairBatch, totals: dict[str, int]) -> tuple[Tensor, Metrics]:
        outputs = pair_outputs(model, batch, cache, with_lm_loss=beta_rm > 0)
        ranking = ranking_loss_sum(logit_scores(outputs.chosen), logit_scores(outputs.rejected))
        loss = reward_model_loss(ranking, outputs.lm_nll_sum, totals["pairs"], totals["tokens"], beta_rm)
        margins = (outputs.chosen_scores - outputs.rejected_scores).detach()
        metrics = {
            "ranking_loss": ranking.item() / totals["pairs"],
            "accuracy": float((margins > 0).sum()) / totals["pairs"],
            "margin": float(margins.sum()) / totals["pairs"],
        }
        if settings.length_debias == "odin":
            penalty = odin_penalty(
                outputs,
                model.score_head.weight,
                model.length_head.weight,
                settings.odin_correlation_weight,
                settings.odin_orthogonality_weight,
            )
            loss = loss + penalty * (len(batch.indices) / totals["pairs"])
            metrics["odin_penalty"] = penalty.item() * len(batch.indices) / totals["pairs"]
        if outputs.lm_nll_sum is not None:
            metrics["lm_loss"] = outputs.lm_nll_sum.item() / totals["tokens"]
        return loss, metrics

    return loss_fn


# --------------------------------------------------------------------------------------------------
# the stage


def run_train_rm(
    config: Config,
    data_dir: Path,
    sft_dir: Path | None,
    out_dir: Path,
    logger: MetricsLogger | None = None,
    train_split: TrainSplit = "rm_train",
) -> StageResult:
    """Train the reward model on `train_split`, select it by `rm_val` accuracy, and write it to `out_dir`.

    `train_split` is rm_train for the reward model PPO optimises against, ppo_pairs for the independent
    judge (rlhf_core/stages/judge_reward.py); out_dir/training_data.json records which it was.
    Holds the output lock for the whole stage; the inputs and the checkpoints' run record are checked
    before `out_dir` is touched, so a rerun that fails there leaves a finished output finished.
    """
    with stage_lock(out_dir, "reward"):
        sft_dir = Path(sft_dir) if sft_dir is not None else None
        return _run_train_rm(config, Path(data_dir), sft_dir, Path(out_dir), logger, train_split)


def encode_reward_pairs(
    tokenizer: PreTrainedTokenizerBase,
    train_records: list[PreferencePair],
    val_records: list[PreferencePair],
    settings: RewardConfig,
    data_dir: Path,
    train_split: TrainSplit,
    seed: int,
) -> tuple[EncodedPairs, EncodedPairs]:
    """The training and validation pairs, encoded (the training pairs length-balanced with
    `reward.length_debias: balanced`); refuses a split with nothing usable."""
    train_pairs = encode_pairs(tokenizer, train_records, settings.max_length)
    if settings.length_debias == "balanced":
        train_pairs = length_balanced_pairs(train_pairs, seed)
    val_pairs = encode_pairs(tokenizer, val_records, settings.max_length)
    if not val_pairs.pairs:
        raise ValueError(f"{data_dir}: the rm_val split has no usable pairs; the reward model cannot be selected")
    if not train_pairs.pairs:
        raise ValueError(f"{data_dir}: the {train_split} split has no usable pairs to train the reward model on")
    return train_pairs, val_pairs


def begin_writing(out_dir: Path, inputs: RunInputs, is_main: bool) -> RunState:
    """Refuse checkpoints of other inputs, then claim `out_dir` for this run: from here on it writes, so the
    output is not complete until it is done; the run's inputs are recorded before its first checkpoint."""
    checkpoint_dir = out_dir / CHECKPOINTS_DIR
    check_resumable(checkpoint_dir, inputs)
    out_dir.mkdir(parents=True, exist_ok=True)
    mark_incomplete(out_dir)
    if is_main:
        record_run_inputs(checkpoint_dir, inputs)
    return RunState(inputs.fingerprint, checkpoint_dir)


def final_metrics(
    config: Config,
    model_dir: Path,
    val_batches: list[PairBatch],
    cache: FrozenLowerCache | None,
    out_dir: Path,
    val_records: list[PreferencePair],
    val_pairs: EncodedPairs,
) -> Metrics:
    """The selected model scored on every validation pair (metrics.json's figures, with the AUC gain's
    bootstrap interval), Figure 2 of them, and the table of each pair's scores (`val_records`: the
    validation pairs, `val_pairs` the encoded ones)."""
    best = RewardModel.from_pretrained(model_dir, dtype=DTYPES[config.model.dtype], device=training_device())
    scores = score_pair_batches(best, val_batches, cache, config.reward.beta_rm > 0)
    plot_margin_histogram(scores.margins, out_dir / MARGIN_PLOT)
    write_validation_pairs(out_dir, validation_pair_rows(val_records, val_pairs, val_batches, scores))
    reply_tokens = scored_reply_tokens(val_pairs, val_batches)
    return validation_metrics(scores, config.reward.beta_rm, reply_tokens, AUC_GAIN_RESAMPLES, config.seed)


def fit_length_residual(
    config: Config,
    model_dir: Path,
    tokenizer: PreTrainedTokenizerBase,
    pairs: EncodedPairs,
    cache: FrozenLowerCache | None,
) -> float:
    """`reward.length_debias: length_residual`: score the training `pairs` with the selected model's head,
    fit the slope on log reply length (`length_slope`) and save the model with it; returns the slope.

    The head's own scores are fitted (slope 0 while scoring), so a rerun after a crash here fits the
    same slope again."""
    model = RewardModel.from_pretrained(model_dir, dtype=DTYPES[config.model.dtype], device=training_device())
    model.length_slope = 0.0
    batches = validation_batches(pairs, config.reward.micro_batch_size, config.seed, tokenizer.pad_token_id)
    scores = score_pair_batches(model, batches, cache, with_lm_loss=False)
    chosen_tokens, rejected_tokens = scored_reply_tokens(pairs, batches)
    model.length_slope = length_slope(
        np.concatenate([scores.chosen, scores.rejected]), np.concatenate([chosen_tokens, rejected_tokens])
    )
    model.save_pretrained(model_dir, tokenizer)
    return model.length_slope


def selected_model_figures(config: Config, run: RewardRun, model_dir: Path, out_dir: Path) -> Metrics:
    """`final_metrics` of the selected model (its length slope fitted first under `length_residual`), in
    the precision it was validated in."""
    with autocast(run.device, config.distributed.uses_bf16):
        if config.reward.length_debias == "length_residual":
            slope = fit_length_residual(config, model_dir, run.tokenizer, run.train_pairs, run.train_cache)
            run.run_state.values["length_slope"] = slope
        return final_metrics(config, model_dir, run.val_batches, run.val_cache, out_dir, run.val_records, run.val_pairs)


@dataclass(frozen=True)
class RewardRun:
    """A reward-model run with its inputs loaded and checked and its output directory claimed: the model
    to train and its tokenizer, the encoded pairs, the frozen-layer caches and the run's state."""

    model: RewardModel
    tokenizer: PreTrainedTokenizerBase
    device: torch.device
    train_pairs: EncodedPairs
    val_records: list[PreferencePair]
    val_pairs: EncodedPairs
    val_batches: list[PairBatch]
    train_cache: FrozenLowerCache | None
    val_cache: FrozenLowerCache | None
    run_state: RunState

    def collate(self, indices: list[int]) -> PairBatch:
        """The training pairs at `indices` as one batch, on the run's device."""
        pairs = [self.train_pairs.pairs[i] for i in indices]
        return collate_pairs(pairs, indices, self.tokenizer.pad_token_id).to(self.device)


def prepare_reward_run(
    config: Config, data_dir: Path, sft_dir: Path | None, out_dir: Path, train_split: TrainSplit, is_main: bool
) -> RewardRun:
    """Load the data (first: a wrong path fails before any model loads), the initial model and the encoded
    pairs, then claim `out_dir` (`begin_writing`) for a run of these inputs."""
    settings = config.reward
    train_records, val_records = load_split(data_dir, train_split), load_split(data_dir, "rm_val")
    device = training_device()
    model, tokenizer, init_hashes = initial_reward_model(config, sft_dir, device)
    train_pairs, val_pairs = encode_reward_pairs(
        tokenizer, train_records, val_records, settings, data_dir, train_split, config.seed
    )
    train_cache, val_cache = frozen_layer_cache(model, settings), frozen_layer_cache(model, settings)
    val_batches = validation_batches(val_pairs, settings.micro_batch_size, config.seed, tokenizer.pad_token_id)
    inputs = RunInputs(
        {**stage_settings(config, "reward"), "train_split": train_split},
        {"data": file_sha256(data_dir / DATA_REPORT_FILE), **init_hashes},
    )
    run_state = begin_writing(out_dir, inputs, is_main)
    return RewardRun(
        model, tokenizer, device, train_pairs, val_records, val_pairs, val_batches, train_cache, val_cache, run_state
    )


def training_figures(result: TrainResult, run: RewardRun) -> Metrics:
    """metrics.json's figures of the training itself: steps, resumption, last loss, pairs used and dropped."""
    return {
        "steps": float(result.final_step),
        "resumed_from": float(result.resumed_from),
        "train_loss": result.metrics["loss"],
        "train_pairs": float(len(run.train_pairs.pairs)),
        "pairs_dropped_too_long": float(len(run.train_pairs.too_long) + len(run.val_pairs.too_long)),
    }


def _run_train_rm(
    config: Config,
    data_dir: Path,
    sft_dir: Path | None,
    out_dir: Path,
    logger: MetricsLogger | None,
    train_split: TrainSplit,
) -> StageResult:
    started = time.monotonic()
    config = resolve_precision(config, training_device(), f"reward ({train_split})")
    settings = config.reward
    context = stage_context(config.distributed)
    run = prepare_reward_run(config, data_dir, sft_dir, out_dir, train_split, context.is_main)
    model_dir = out_dir / MODEL_DIR

    def evaluate(model: nn.Module, max_batches: int | None) -> Metrics:
        batches = run.val_batches[:max_batches]
        scores = score_pair_batches(model, batches, run.val_cache, settings.beta_rm > 0)
        return validation_metrics(scores, settings.beta_rm, scored_reply_tokens(run.val_pairs, batches))

    def save_best(model: nn.Module, step: int, metrics: Metrics) -> None:
        model.save_pretrained(model_dir, run.tokenizer)
        run.run_state.values["best_step"] = float(step)

    plan = pair_batch_plan(run.train_pairs, settings, config.seed, context.world_size)
    loop = loop_config(settings, config, "warmup_constant")
    with loop_logger(out_dir, logger, total_steps(loop, plan), context.is_main) as logger_for_loop:
        reward, precision = settings.model_dump(mode="json"), precision_record(config)
        logger_for_loop.log_params(
            {"reward": reward, "sft_dir": str(sft_dir), "train_split": train_split, "precision": precision}
        )
        result = train(
            run.model,
            plan,
            run.collate,
            count_pairs_and_tokens,
            reward_loss_fn(run.train_cache, settings),
            loop,
            evaluate=evaluate,
            select_best=("val/accuracy", "max"),
            on_best=save_best,
            checkpoint_dir=run.run_state.checkpoint_dir,
            logger=logger_for_loop,
            extra_state=run.run_state,
            distributed=config.distributed,
        )
    if not context.is_main:  # rank 0 saved the best model and writes the stage's figures
        return StageResult(out_dir=out_dir, metrics=result.metrics, model_dir=model_dir)
    metrics = {
        **selected_model_figures(config, run, model_dir, out_dir),
        **run.run_state.values,
        **training_figures(result, run),
        "wall_seconds": time.monotonic() - started,
    }
    write_training_data(out_dir, training_data_record(data_dir, train_split, settings.init_from))
    write_metrics(out_dir, metrics)
    return StageResult(out_dir=out_dir, metrics=metrics, model_dir=model_dir)
