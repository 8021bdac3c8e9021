"""Batched sampling with Hugging Face `generate`: left-padded prompts, the stop tokens, the reply mask.

Layout: prompts are LEFT-padded to a common width P, so one batched, KV-cached `generate` call continues
every prompt at column P; replies come back RIGHT-padded to width T, with the pad id after each stop
token. PPO's `hf` rollout engine (engine.py) and evaluation's replies (rlhf_core/evaluation/generation.py)
sample through here; the lean engine (lean_engine.py) uses the same padding and stop handling.

Sampling: rollouts default to temperature-only sampling, so the sampling distribution IS the
temperature-scaled policy and PPO stays on-policy. Nucleus sampling (`top_p` < 1) and a repetition
penalty (the paper's p = 0.9, 1.1) change the sampling distribution without changing the log-probs
PPO computes, which makes the rollout off-policy; they are options, documented as such.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor
from transformers import GenerationConfig as HFGenerationConfig
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from rlhf_core.config import GenerationConfig
from rlhf_core.models.chat import end_of_turn_id


def left_pad(
    sequences: Sequence[Sequence[int]], pad_id: int, device: torch.device | str = "cpu"
) -> tuple[Tensor, Tensor]:
    """Token-id lists -> ids and mask ``[B, max_len]`` (long), padded on the LEFT for generation."""
    if not sequences or any(len(sequence) == 0 for sequence in sequences):
        raise ValueError("left_pad needs at least one sequence and no empty sequence")
    width = max(len(sequence) for sequence in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, sequence in enumerate(sequences):
        ids[row, width - len(sequence) :] = torch.tensor(sequence, dtype=torch.long)
        mask[row, width - len(sequence) :] = 1
    return ids.to(device), mask.to(device)


def stop_token_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The ids that end a reply: the end-of-turn token, and eos when it is a different token."""
    stop_ids = [end_of_turn_id(tokenizer)]
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in stop_ids:
        stop_ids.append(tokenizer.eos_token_id)
    return stop_ids


def sampling_config(settings: GenerationConfig, stop_ids: list[int], pad_id: int) -> HFGenerationConfig:
    """A complete Hugging Face generation config: nothing is inherited from the model's defaults.

    `top_k=0` switches off transformers' top-k filter, so with `top_p=1` and `repetition_penalty=1`
    tokens are drawn from ``softmax(logits / temperature)`` exactly.
    """
    return HFGenerationConfig(
        do_sample=True,
        temperature=settings.temperature,
        top_k=0,
        top_p=settings.top_p,
        repetition_penalty=settings.repetition_penalty,
        max_new_tokens=settings.max_new_tokens,
        eos_token_id=stop_ids,
        pad_token_id=pad_id,
        use_cache=True,
    )


def mask_after_stop(response_ids: Tensor, stop_ids: list[int]) -> tuple[Tensor, Tensor]:
    """Response mask ``[B, T]`` (long) and finished flags ``[B]`` (bool) of generated tokens.

    A response runs up to and including its first stop token; everything after it is padding (even
    when the pad id is the stop id itself, as in SmolLM2). A row without a stop token was cut at the
    length limit: all its tokens are real and it is not finished.
    """
    is_stop = torch.isin(response_ids, torch.tensor(stop_ids, device=response_ids.device))
    stops_before = is_stop.long().cumsum(dim=1) - is_stop.long()
    mask = (stops_before == 0).long()
    return mask, is_stop.any(dim=1)


@torch.no_grad()
def generate_responses(
    policy: PreTrainedModel,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    settings: GenerationConfig,
    stop_ids: list[int],
    pad_id: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """Sample one response per left-padded prompt with one batched, KV-cached `generate` call.

    Returns response ids ``[B, T]`` (pad after the stop token), mask ``[B, T]`` and finished ``[B]``;
    ``T <= settings.max_new_tokens`` (generation stops once every row has finished). Draws from
    torch's global random generator, so a seeded (or checkpoint-restored) state gives the same
    responses.
    """
    output = policy.generate(
        input_ids=prompt_ids, attention_mask=prompt_mask, generation_config=sampling_config(settings, stop_ids, pad_id)
    )
    response_ids = output[:, prompt_ids.shape[1] :]
    mask, finished = mask_after_stop(response_ids, stop_ids)
    return torch.where(mask.bool(), response_ids, pad_id), mask, finished
