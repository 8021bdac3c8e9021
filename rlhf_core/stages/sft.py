"""Stage `sft`: supervised fine-tuning of the base chat model on prompt + chosen reply (paper section 4.1).

The loss is the token-level NLL of the assistant reply (and its end-of-turn token) only, averaged over
the reply tokens of each whole optimizer step. The schedule is linear warmup, then cosine decay to
`min_lr_ratio` of the peak (section 5.1). The stage measures the perplexity of held-out chosen replies
(the `eval` split, or `rm_val` when that is empty) before and after training.

`sft.skip: true` hands the base model on untrained (SmolLM2-Instruct already is a chat model): model/
is the base model and metrics.json records `skipped: 1`.

Outputs in `out_dir`: model/ (Hugging Face format), history.jsonl, plots/sft_curves.png (training loss
and held-out perplexity over the steps; not with `skip`), checkpoints/ (a rerun with the same settings and
data resumes from the newest; `run_inputs.json` there records them), metrics.json (written last).

Under the deepspeed launcher (`distributed.num_processes > 1`) every rank runs this function; each
trains its shard of every step (`sft.micro_batch_size * grad_accum_steps` sequences per rank), and only
rank 0 writes model/, history.jsonl and metrics.json.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from torch import Tensor, nn
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from rlhf_core.config import Config
from rlhf_core.data.prepare import load_split
from rlhf_core.data.records import PreferencePair
from rlhf_core.distributed.context import RankContext, stage_context
from rlhf_core.distributed.zero import gathered_parameters
from rlhf_core.layout import CHECKPOINTS_DIR, DATA_REPORT_FILE, HISTORY_FILE, MODEL_DIR
from rlhf_core.models.base import load_base_model
from rlhf_core.models.freezing import enable_gradient_checkpointing
from rlhf_core.models.lora import make_trainable
from rlhf_core.models.saving import save_causal_lm
from rlhf_core.sft.batch import EncodedExamples, SequenceBatch, collate_sequences, encode_examples, evaluation_chunks
from rlhf_core.sft.loss import causal_lm_reply_nll, count_target_tokens, heldout_reply_nll, perplexity
from rlhf_core.sft.plots import CURVES_FILE, plot_sft_curves, read_history
from rlhf_core.stages.precision import precision_record, resolve_precision
from rlhf_core.stages.result import StageResult, write_metrics
from rlhf_core.stages.training_run import (
    RunInputs,
    RunState,
    check_resumable,
    file_sha256,
    loop_config,
    mark_incomplete,
    record_run_inputs,
    stage_lock,
    stage_logger,
    stage_settings,
    training_device,
)
from rlhf_core.training.batching import BatchPlan, batch_plan
from rlhf_core.training.checkpoint import latest_checkpoint
from rlhf_core.training.logger import JsonlLogger, MetricsLogger, NullLogger
from rlhf_core.training.loop import run_evaluation, total_steps, train
from rlhf_core.training.vocabulary_gradients import accumulate_vocabulary_gradients_in_place

Metrics = dict[str, float]


def heldout_pairs(data_dir: Path) -> list[PreferencePair]:
    """The held-out pairs whose chosen replies measure perplexity: `eval`, else `rm_val`."""
    for split in ("eval", "rm_val"):
        pairs = load_split(data_dir, split)
        if pairs:
            return pairs
    raise ValueError(f"{data_dir}: the eval and rm_val splits are both empty; no held-out replies to measure")


def heldout_batches(encoded: EncodedExamples, batch_size: int, seed: int, pad_id: int) -> list[SequenceBatch]:
    """The held-out replies as batches in a fixed seeded order (periodic validations use the first few)."""
    return [
        collate_sequences([encoded.encoded[i] for i in chunk], pad_id)
        for chunk in evaluation_chunks(len(encoded.encoded), batch_size, seed)
    ]


def perplexity_evaluator(batches: list[SequenceBatch]) -> Callable[[nn.Module, int | None], Metrics]:
    """The loop's `evaluate`: mean NLL and perplexity of the held-out replies (the first `max_batches`)."""

    def evaluate(model: nn.Module, max_batches: int | None) -> Metrics:
        nll_sum, tokens = heldout_reply_nll(model, batches[:max_batches])
        return {"val/nll": nll_sum / tokens, "val/perplexity": perplexity(nll_sum, tokens)}

    return evaluate


def sft_loss(model: nn.Module, batch: SequenceBatch, totals: dict[str, int]) -> tuple[Tensor, Metrics]:
    """Summed reply-token NLL of the micro-batch over the reply tokens of the whole optimizer step."""
    return causal_lm_reply_nll(model, batch) / totals["tokens"], {}


def count_tokens(batch: SequenceBatch) -> dict[str, int]:
    """The unit SFT averages over: predicted reply tokens."""
    return {"tokens": count_target_tokens(batch.labels)}


def _save_model(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, out_dir: Path) -> Path:
    """Write model/ atomically, ready for generation (KV cache on, even if training turned it off)."""
    model.eval()
    model.config.use_cache = True
    return save_causal_lm(model, tokenizer, out_dir / MODEL_DIR)


def _hand_on_base_model(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    evaluate: Callable[[nn.Module, int | None], Metrics],
    out_dir: Path,
    bf16: bool,
    context: RankContext,
) -> Metrics:
    """`sft.skip`: save the base model as this stage's model and measure it once (before == after)."""
    measured = run_evaluation(model, evaluate, None, bf16)
    if context.is_main:
        _save_model(model, tokenizer, out_dir)
    return {
        "skipped": 1.0,
        "steps": 0.0,
        "nll_before": measured["val/nll"],
        "nll_after": measured["val/nll"],
        "perplexity_before": measured["val/perplexity"],
        "perplexity_after": measured["val/perplexity"],
    }


def run_sft(config: Config, data_dir: Path, out_dir: Path, logger: MetricsLogger | None = None) -> StageResult:
    """Fine-tune the base model on the `sft` split into `out_dir` (resuming from its checkpoints).

    Holds the output lock for the whole stage. The data and the checkpoints' run record are checked
    before `out_dir` is touched, so a rerun that fails there leaves a finished output finished.
    """
    with stage_lock(out_dir, "sft"):
        return _run_sft(config, Path(data_dir), Path(out_dir), logger)


def _run_sft(config: Config, data_dir: Path, out_dir: Path, logger: MetricsLogger | None) -> StageResult:
    started = time.monotonic()
    config = resolve_precision(config, training_device(), "sft")
    settings = config.sft
    context = stage_context(config.distributed)
    examples = load_split(data_dir, "sft")  # read the data first: a wrong path fails before any model loads
    pairs = heldout_pairs(data_dir)
    inputs = RunInputs(stage_settings(config, "sft"), {"data": file_sha256(data_dir / DATA_REPORT_FILE)})
    if not settings.skip:
        check_resumable(out_dir / CHECKPOINTS_DIR, inputs)
    model, tokenizer = load_base_model(config.model, training_device())
    pad_id = tokenizer.pad_token_id
    train_set = encode_examples(tokenizer, [(e.prompt, e.response) for e in examples], settings.max_length)
    heldout = encode_examples(tokenizer, [(p.prompt, p.chosen) for p in pairs], settings.max_length)
    evaluate = perplexity_evaluator(heldout_batches(heldout, settings.micro_batch_size, config.seed, pad_id))
    counts = {
        "train_examples": float(len(train_set.encoded)),
        "heldout_examples": float(len(heldout.encoded)),
        "examples_dropped_too_long": float(len(train_set.too_long) + len(heldout.too_long)),
    }

    out_dir.mkdir(parents=True, exist_ok=True)
    mark_incomplete(out_dir)  # from here on this run writes: the output is not complete until it is done
    if settings.skip:
        metrics = _hand_on_base_model(model, tokenizer, evaluate, out_dir, config.distributed.uses_bf16, context)
    else:
        if context.is_main:
            record_run_inputs(out_dir / CHECKPOINTS_DIR, inputs)
        run_state = RunState(inputs.fingerprint, out_dir / CHECKPOINTS_DIR)
        metrics = _train(config, model, tokenizer, train_set, evaluate, run_state, out_dir, logger, context)
    metrics.update(counts)
    metrics["wall_seconds"] = time.monotonic() - started
    if context.is_main:
        write_metrics(out_dir, metrics)
    return StageResult(out_dir=out_dir, metrics=metrics, model_dir=out_dir / MODEL_DIR)


def _make_trainable(model: PreTrainedModel, config: Config, context: RankContext) -> None:
    """Unfreeze what `sft` trains (top layers or LoRA), with the memory savings it asks for."""
    settings = config.sft
    make_trainable(model, settings.trainable_top_layers, settings.lora, config.seed)
    if not context.is_distributed:  # DeepSpeed takes each gradient from autograd itself
        accumulate_vocabulary_gradients_in_place(model)
    if settings.gradient_checkpointing:
        enable_gradient_checkpointing(model)


def _measure_base_model(
    model: PreTrainedModel, evaluate: Callable[[nn.Module, int | None], Metrics], run_state: RunState, bf16: bool
) -> None:
    """The base model's held-out figures into `run_state`; a resumed run restores them from its checkpoint
    instead."""
    if latest_checkpoint(run_state.checkpoint_dir) is None:
        before = run_evaluation(model, evaluate, None, bf16)
        run_state.values.update({"nll_before": before["val/nll"], "perplexity_before": before["val/perplexity"]})


def _save_model_and_curves(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, out_dir: Path, run_state: RunState, context: RankContext
) -> None:
    """model/ (gathered from every rank under ZeRO-3, written by rank 0) and the training curves."""
    with gathered_parameters(model):
        if context.is_main:
            _save_model(model, tokenizer, out_dir)
    if context.is_main:
        before = run_state.values.get("perplexity_before")
        plot_sft_curves(read_history(out_dir / HISTORY_FILE), before, out_dir / CURVES_FILE)


def _batch_plan(config: Config, train_set: EncodedExamples, world_size: int) -> BatchPlan:
    """The global batches of the epochs, as `sft.batching` groups them: grad_accum_steps micro-batches per
    rank, every rank its shard."""
    settings = config.sft
    return batch_plan(
        settings.batching,
        [len(example.input_ids) for example in train_set.encoded],
        config.seed,
        micro_batch_size=settings.micro_batch_size,
        token_budget=settings.token_budget,
        accumulation_steps=settings.grad_accum_steps * world_size,
    )


def _train(
    config: Config,
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    train_set: EncodedExamples,
    evaluate: Callable[[nn.Module, int | None], Metrics],
    run_state: RunState,
    out_dir: Path,
    logger: MetricsLogger | None,
    context: RankContext,
) -> Metrics:
    """Measure the base model, train with the shared loop, save model/, and return the stage's figures."""
    settings = config.sft
    _make_trainable(model, config, context)
    device = next(model.parameters()).device
    pad_id = tokenizer.pad_token_id
    plan = _batch_plan(config, train_set, context.world_size)
    loop = loop_config(settings, config, "warmup_cosine", settings.min_lr_ratio)
    _measure_base_model(model, evaluate, run_state, loop.bf16)

    def collate(indices: list[int]) -> SequenceBatch:
        return collate_sequences([train_set.encoded[i] for i in indices], pad_id).to(device)

    history = JsonlLogger(out_dir / HISTORY_FILE) if context.is_main else None
    try:
        logger_for_loop = stage_logger(history, logger, total_steps(loop, plan)) if history else NullLogger()
        logger_for_loop.log_params({"sft": settings.model_dump(mode="json"), "precision": precision_record(config)})
        result = train(
            model,
            plan,
            collate,
            count_tokens,
            sft_loss,
            loop,
            evaluate=evaluate,
            checkpoint_dir=run_state.checkpoint_dir,
            logger=logger_for_loop,
            extra_state=run_state,
            distributed=config.distributed,
        )
    finally:
        if history is not None:
            history.close()
    _save_model_and_curves(model, tokenizer, out_dir, run_state, context)
    return {
        "skipped": 0.0,
        "steps": float(result.final_step),
        "resumed_from": float(result.resumed_from),
        "train_loss": result.metrics["loss"],
        **run_state.values,
        "nll_after": result.metrics["val/nll"],
        "perplexity_after": result.metrics["val/perplexity"],
    }
