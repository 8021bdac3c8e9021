"""Each stage's passes over its own inputs, rebuilt the way the stage builds them, as `stage_flops.Work`.

The batches come from rlhf_core's own code: the prepared splits under the run's data/, the chat
encoding (`encode_conversation`, `encode_prompt`), the SFT and reward batch plans and collation, the
validation chunks. What the run's files cannot say is approximated and named where it is (the PPO
replies' per-row lengths, the evaluation's per-batch decode lengths); docs/stage-bounds.md lists it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from stage_flops import ModelShape, Work, batch_pass, cached_lower_pass, generation, total
from transformers import PreTrainedTokenizerBase

from rlhf_core.data.prepare import load_split
from rlhf_core.evaluation.prompts import evaluation_prompts
from rlhf_core.models.chat import EncodedConversation, encode_prompt
from rlhf_core.ppo.scoring import chunks
from rlhf_core.reward.batch import EncodedPair, encode_pairs, padded_pair_length
from rlhf_core.sft.batch import encode_examples, evaluation_chunks
from rlhf_core.stages.sft import heldout_pairs
from rlhf_core.training.batching import BatchPlan, batch_plan, fixed_size_plan

Params = Mapping[str, Any]


def validation_batch_counts(total_steps: int, eval_every: int | None, eval_batches: int, batches: int) -> list[int]:
    """Batches each validation of the training loop scores: `eval_batches` every `eval_every` steps before
    the last, all of them after the last (rlhf_core/training/loop.py `_evaluate_step`)."""
    periodic = [] if eval_every is None else range(eval_every, total_steps, eval_every)
    return [min(eval_batches, batches) for _ in periodic] + [batches]


def targets(conversation: EncodedConversation) -> int:
    """Reply tokens the LM head predicts in a sequence (`count_target_tokens`: never position 0)."""
    return len(conversation.input_ids) - max(conversation.reply_start, 1)


def lm_batch(shape: ModelShape, batch: Sequence[EncodedConversation], blocks: int, trained: int = 0) -> Work:
    """A right-padded batch with the LM head at its reply targets (SFT, perplexities)."""
    lengths = [len(item.input_ids) for item in batch]
    return batch_pass(shape, lengths, blocks, sum(targets(item) for item in batch), trained)


def plan_batches(plan: BatchPlan, steps: int) -> list[list[int]]:
    """Every micro-batch of the first `steps` optimizer steps."""
    return [micro for step in range(steps) for micro in plan.step(step)]


def sft_work(shape: ModelShape, tokenizer: PreTrainedTokenizerBase, data_dir: Path, params: Params) -> Work:
    """SFT: the whole model forward on every micro-batch, backward through the trained top blocks, the
    held-out perplexity before training, every `eval_every` steps and after the last."""
    settings, seed, steps = params["sft"], params["loop"]["seed"], params["total_steps"]
    size, trained = settings["micro_batch_size"], settings["trainable_top_layers"] or shape.layers
    examples = load_split(data_dir, "sft")
    train = encode_examples(tokenizer, [(e.prompt, e.response) for e in examples], settings["max_length"]).encoded
    plan = logged_plan(settings, [len(example.input_ids) for example in train], seed)
    works = [lm_batch(shape, [train[i] for i in micro], shape.layers, trained) for micro in plan_batches(plan, steps)]
    pairs = heldout_pairs(data_dir)
    heldout = encode_examples(tokenizer, [(p.prompt, p.chosen) for p in pairs], settings["max_length"]).encoded
    batches = [[heldout[i] for i in chunk] for chunk in evaluation_chunks(len(heldout), size, seed)]
    counts = [len(batches)] + validation_batch_counts(
        steps, settings["eval_every"], settings["eval_batches"], len(batches)
    )
    works += [lm_batch(shape, batch, shape.layers) for count in counts for batch in batches[:count]]
    return total(works)


def pair_batch(shape: ModelShape, pairs: Sequence[EncodedPair], blocks: int, lm: bool, trained: int = 0) -> Work:
    """Both sides of a pair micro-batch (each padded to its own longest) through the top `blocks` blocks,
    the LM head at the chosen replies' targets when the LM term is on."""
    chosen = [pair.chosen for pair in pairs]
    head = sum(targets(item) for item in chosen) if lm else 0
    chosen_work = batch_pass(shape, [len(item.input_ids) for item in chosen], blocks, head, trained)
    rejected_work = batch_pass(shape, [len(pair.rejected.input_ids) for pair in pairs], blocks, 0, trained)
    return chosen_work + rejected_work


def logged_plan(settings: Params, lengths: Sequence[int], seed: int) -> BatchPlan:
    """The stage's batch plan (`batch_plan`, as SFT and `pair_batch_plan` build it) from its logged
    settings; a run logged before SFT had a `batching` setting used fixed-size batches."""
    return batch_plan(
        settings.get("batching", "fixed"),
        lengths,
        seed,
        micro_batch_size=settings["micro_batch_size"],
        token_budget=settings.get("token_budget", 0),
        accumulation_steps=settings["grad_accum_steps"],
    )


def reward_work(shape: ModelShape, tokenizer: PreTrainedTokenizerBase, data_dir: Path, params: Params) -> Work:
    """A reward model (train-rm or the judge): training micro-batches, validations, the length-residual
    fit over the training pairs, the final scoring of the selected model; with the frozen-layer cache the
    lower blocks run once per distinct sequence, alone and unpadded, and every pass runs only the top."""
    settings, seed, steps = params["reward"], params["loop"]["seed"], params["total_steps"]
    size, lm = settings["micro_batch_size"], settings["beta_rm"] > 0
    trained = settings["trainable_top_layers"] or shape.layers
    cached = settings["cache_frozen_layers"] and trained < shape.layers
    blocks = trained if cached else shape.layers
    train = encode_pairs(tokenizer, load_split(data_dir, params["train_split"]), settings["max_length"]).pairs
    val = encode_pairs(tokenizer, load_split(data_dir, "rm_val"), settings["max_length"]).pairs
    micros = plan_batches(logged_plan(settings, [padded_pair_length(pair) for pair in train], seed), steps)
    works = [pair_batch(shape, [train[i] for i in micro], blocks, lm, trained) for micro in micros]
    val_batches = [[val[i] for i in chunk] for chunk in evaluation_chunks(len(val), size, seed)]
    counts = validation_batch_counts(steps, settings["eval_every"], settings["eval_batches"], len(val_batches))
    counts.append(len(val_batches))  # final_metrics: the selected model on every validation pair
    works += [pair_batch(shape, batch, blocks, lm) for count in counts for batch in val_batches[:count]]
    seen = {i for micro in micros for i in micro}
    if settings["length_debias"] == "length_residual":  # the selected head scores every training pair
        works += [
            pair_batch(shape, [train[i] for i in chunk], blocks, False)
            for chunk in evaluation_chunks(len(train), size, seed)
        ]
        seen = set(range(len(train)))
    if cached:
        sequences = [pair.chosen for pair in val] + [pair.rejected for pair in val]
        sequences += [side for i in sorted(seen) for side in (train[i].chosen, train[i].rejected)]
        works.append(cached_lower_pass(shape, [len(item.input_ids) for item in sequences], shape.layers - trained))
    return total(works)


def rollout_work(
    shape: ModelShape, prompt_lengths: list[int], steps: int, reply_tokens: int, scoring_rows: int, upper: int,
    trunk_pass: bool,
) -> Work:  # fmt: skip
    """One batch of PPO prompts (sorted by length, left-padded) sampled for `steps` columns, then the scoring
    passes per micro-batch of `scoring_rows`: policy and reference log-probs (LM head over the response),
    critic values, reward score, each through the `upper` blocks above the shared trunk; with
    `trunk_pass`, the trunk itself once more (validation; a rollout's engine hands it back)."""
    rows = len(prompt_lengths)
    reply_each = reply_tokens / rows
    work = generation(shape, rows, max(prompt_lengths), steps, sum(prompt_lengths) + reply_tokens)
    for micro in chunks(rows, scoring_rows):
        prompts = prompt_lengths[micro]
        lengths = [round(length + reply_each) for length in prompts]
        width = max(prompts) + steps
        logprobs = batch_pass(shape, lengths, upper, len(lengths) * steps, width=width)
        score = batch_pass(shape, lengths, upper, width=width)
        work = work + logprobs + logprobs + score + score
        if trunk_pass:
            work = work + batch_pass(shape, lengths, shape.layers - upper, width=width)
    return work


def update_work(
    shape: ModelShape, prompt_lengths: list[int], steps: int, reply_tokens: int, ppo: Params, policy: bool
) -> Work:
    """The update of one rollout: `ppo_epochs` passes over its rows in micro-batches, the critic forward
    and backward and, after critic pretraining, the policy's (LM head over the response). Mini-batches are
    shuffled, so each micro-batch is taken as padded to the rollout's widest prompt (an upper estimate)."""
    upper, rows = ppo["trainable_top_layers"], len(prompt_lengths)
    width = max(prompt_lengths) + steps
    work = Work()
    for _ in range(ppo["ppo_epochs"]):
        for micro in chunks(rows, ppo["micro_batch_size"]):
            lengths = [round(length + reply_tokens / rows) for length in prompt_lengths[micro]]
            work = work + batch_pass(shape, lengths, upper, trained_blocks=upper, width=width)
            if policy:
                work = work + batch_pass(shape, lengths, upper, len(lengths) * steps, upper, width=width)
    return work


def decode_length(record: Mapping[str, float], max_new_tokens: int) -> int:
    """Columns a rollout sampled: all of them when a reply was cut, else its mean reply length (the
    longest is not logged, so that case is a lower estimate)."""
    if record.get("response/finished_fraction", 0.0) < 1.0:
        return max_new_tokens
    return math.ceil(record["response/length_mean"])


def ppo_work(
    shape: ModelShape, tokenizer: PreTrainedTokenizerBase, data_dir: Path, params: Params,
    history: Sequence[Mapping[str, float]], critic_only: int,
) -> Work:  # fmt: skip
    """PPO: every logged iteration's rollout (its prompts from the stage's own seeded prompt plan), scoring
    and update, and every logged validation on the held-out prompts."""
    ppo, seed = params["ppo"], params["seed"]
    upper = ppo["trainable_top_layers"] or shape.layers
    rows, new = ppo["rollout_batch_size"], ppo["rollout"]["max_new_tokens"]
    scoring_rows = ppo["scoring_batch_size"] or ppo["micro_batch_size"]
    prompts = [
        encode_prompt(tokenizer, p.prompt, ppo["max_prompt_tokens"]) for p in load_split(data_dir, "ppo_prompts")
    ]
    plan = fixed_size_plan(len(prompts), seed, rows, 1)
    iterations = [record for record in history if "time/generate_s" in record]
    works = []
    for index, record in enumerate(iterations):
        (batch,) = plan.step(index)
        lengths = sorted(len(prompts[i]) for i in batch)
        steps, replies = decode_length(record, new), int(record["rollout/generated_tokens"])
        works.append(rollout_work(shape, lengths, steps, replies, scoring_rows, upper, False))
        works.append(update_work(shape, lengths, steps, replies, ppo, policy=index + 1 > critic_only))
    val = sorted(
        len(encode_prompt(tokenizer, p.prompt, ppo["max_prompt_tokens"]))
        for p in load_split(data_dir, "ppo_val_prompts")
    )
    for record in (r for r in history if "val/prompts" in r):
        for chunk in chunks(len(val), rows):
            lengths = val[chunk]
            replies = round(record["val/length"] * len(lengths))
            works.append(rollout_work(shape, lengths, new, replies, scoring_rows, upper, True))
    return total(works)


def evaluation_work(
    shape: ModelShape, tokenizer: PreTrainedTokenizerBase, data_dir: Path, config: Params,
    reply_tokens: tuple[float, float] | None,
) -> Work:  # fmt: skip
    """Evaluation of two models: each samples `length_matched_samples` replies per prompt in batches of
    `evaluation.batch_size` (the extra ones with each prompt repeated), every batch taken to run all
    `max_new_tokens` columns; each model's perplexity on the reference replies; the judge RM over the pairs
    of the length-controlled win rate (`length_controlled_samples` per prompt, the main one included) and
    as many length-matched pairs as prompts, in batches of the replies sorted by length as the judge cuts
    them (an upper estimate: a pair judged twice is scored once). `reply_tokens`: the mean reply length of
    model A and B (generations.jsonl), or None for `max_new_tokens` (an upper estimate)."""
    evaluation, sft = config["evaluation"], config["sft"]
    new, samples = evaluation["generation"]["max_new_tokens"], evaluation["length_matched_samples"]
    batch_size = evaluation.get("batch_size", 8)  # 8: runs from before the setting
    prompts = evaluation_prompts(data_dir, evaluation["max_prompts"])
    lengths = [len(encode_prompt(tokenizer, p.prompt)) for p in prompts]
    references = encode_examples(tokenizer, [(p.prompt, p.reference_reply) for p in prompts], sft["max_length"]).encoded
    works = []
    for mean in reply_tokens or (new, new):
        orders = [lengths] + ([[n for n in lengths for _ in range(samples - 1)]] if samples > 1 else [])
        for order in orders:
            for start in range(0, len(order), batch_size):
                batch = order[start : start + batch_size]
                works.append(generation(shape, len(batch), max(batch), new, sum(batch) + round(mean * len(batch))))
        size = sft["micro_batch_size"]
        works += [lm_batch(shape, references[i : i + size], shape.layers) for i in range(0, len(references), size)]
    pairs_per_prompt = evaluation.get("length_controlled_samples") or samples
    judged = sorted([n + round(mean) for mean in reply_tokens or (new, new) for n in lengths] * (pairs_per_prompt + 1))
    size = config["reward"]["micro_batch_size"]
    works += [batch_pass(shape, judged[i : i + size], shape.layers) for i in range(0, len(judged), size)]
    return total(works)
