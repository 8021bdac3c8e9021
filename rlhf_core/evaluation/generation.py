"""Replies of one model to the evaluation prompts, sampled with the paper's settings (section 6).

`evaluation.generation` in params.yaml holds them: nucleus sampling with p = 0.9, temperature 0.8,
repetition penalty 1.1, one reply per prompt, up to `max_new_tokens` tokens. Prompts are rendered by
the model's own chat template (`chat.encode_prompt`, whole: the eval split is length-filtered), left-
padded and sampled in batches by the rollout engine `evaluation.generation.engine` names (rlhf_core/
rollout/engines.py; by default the lean CPU loop PPO samples with, faster than transformers' `generate`
on a CPU, docs/rollout-engine.md; `hf` for `generate`), which stops each reply at the end-of-turn token.
Sampling starts from `seed`, inside a forked random state, so both models of a comparison are sampled with
the same seed and the caller's random state is untouched.
Given a `desc`, a progress bar counts the prompts answered (rlhf_core/progress.py).
`sample_replies` draws several replies per prompt (for the length-matched pairs, length_matching.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from rlhf_core.config import RolloutConfig
from rlhf_core.data.records import Message
from rlhf_core.models.chat import encode_prompt
from rlhf_core.progress import progress
from rlhf_core.rollout.engine import SamplingParams
from rlhf_core.rollout.engines import make_rollout_engine
from rlhf_core.rollout.generation import left_pad, stop_token_ids


@dataclass(frozen=True)
class Reply:
    """A generated reply: its text (without the end-of-turn token), its token count, and whether it ended
    with the end-of-turn token (False: cut at `max_new_tokens`)."""

    text: str
    tokens: int
    finished: bool


@torch.no_grad()
def generate_replies(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[Sequence[Message]],
    settings: RolloutConfig,
    batch_size: int,
    seed: int,
    desc: str | None = None,
) -> list[Reply]:
    """One sampled reply per prompt, in the order of `prompts` (see the module docstring); with `desc`, a
    progress bar of that label over the prompts."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    device = next(model.parameters()).device
    engine = make_rollout_engine(settings, model, batch_size)
    sampling = SamplingParams(settings, tuple(stop_token_ids(tokenizer)), tokenizer.pad_token_id)
    replies: list[Reply] = []
    bar = progress(len(prompts), desc, "prompt") if desc is not None else nullcontext()
    with bar as answered, torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        for start in range(0, len(prompts), batch_size):
            encoded = [encode_prompt(tokenizer, prompt) for prompt in prompts[start : start + batch_size]]
            prompt_ids, prompt_mask = left_pad(encoded, tokenizer.pad_token_id, device)
            generation = engine.generate(prompt_ids, prompt_mask, sampling)
            for ids, mask, done in zip(generation.response_ids, generation.response_mask, generation.finished):
                reply_ids = ids[mask.bool()].tolist()
                if done:
                    reply_ids = reply_ids[:-1]  # the end-of-turn token
                text = tokenizer.decode(reply_ids, skip_special_tokens=True).strip()
                replies.append(Reply(text=text, tokens=len(reply_ids), finished=bool(done)))
            if answered is not None:
                answered.advance(len(encoded))
    return replies


def sample_replies(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[Sequence[Message]],
    settings: RolloutConfig,
    batch_size: int,
    seed: int,
    samples: int,
    desc: str | None = None,
) -> list[list[Reply]]:
    """`samples` replies per prompt (result[p]: the replies to prompts[p]): each prompt repeated `samples`
    times in a row through `generate_replies`, so a batch holds copies of few prompts (little padding)."""
    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")
    repeated = [prompt for prompt in prompts for _ in range(samples)]
    replies = generate_replies(model, tokenizer, repeated, settings, batch_size, seed, desc)
    return [replies[start : start + samples] for start in range(0, len(replies), samples)]
