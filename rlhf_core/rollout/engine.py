"""The rollout-engine interface: what samples PPO's responses, behind one small protocol.

The trainer needs one thing from generation: for a batch of left-padded prompts, one sampled reply each
(ids, mask, finished), drawn from the current policy. Everything else - the log-probs PPO optimises, the
values, the rewards - the trainer computes itself from those tokens in its float32 scoring passes
(experience_maker.py). So an engine is free to sample however it likes as long as it samples the policy's
distribution: Hugging Face `generate` on the policy module (`HFGenerateEngine`), the lean CPU loop
(`lean_engine.LeanEngine`), or a serving engine on a GPU worker (vLLM, as OpenRLHF and verl do; see
docs/rollout-engine.md for what such an engine needs). Before each rollout the trainer calls
`sync_weights(policy)`: a no-op for an engine that samples the policy module itself, a weight copy for one
that keeps its own.

`ppo.rollout.engine` and `evaluation.generation.engine` pick the engine (engines.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor
from transformers import PreTrainedModel

from rlhf_core.config.generation import RolloutConfig
from rlhf_core.rollout.generation import generate_responses, mask_after_stop


@dataclass(frozen=True)
class SamplingParams:
    """How to sample: the settings, the ids that end a reply, the id that pads after it."""

    settings: RolloutConfig
    stop_ids: tuple[int, ...]
    pad_id: int


@dataclass(frozen=True)
class Generation:
    """One reply per prompt: ids ``[B, T]`` (pad after the stop token), mask ``[B, T]``, finished ``[B]``.

    `logprobs` ``[B, T]`` (0 on padding) are the engine's own log-probs of the sampled tokens under the
    distribution it sampled from, when it reports them; PPO never trains on them (module doc), the
    experience maker only measures how far they are from its float32 scoring pass's. `trunk_residual`
    ``[B, P + T, hidden]``, when the engine was asked for it, is the policy's residual stream entering
    block `num_lower` at every column: the shared trunk's states (shared_trunk.py), computed on the way.
    """

    response_ids: Tensor
    response_mask: Tensor
    finished: Tensor
    logprobs: Tensor | None = None
    trunk_residual: Tensor | None = None


class RolloutEngine(Protocol):
    """Samples replies from the policy; `sync_weights` hands it the policy's current weights."""

    def generate(
        self, prompt_ids: Tensor, prompt_mask: Tensor, params: SamplingParams, seed: int | None = None
    ) -> Generation:
        """One reply per left-padded prompt ``[B, P]``; draws from torch's global generator when `seed` is
        None (so a seeded or checkpoint-restored state repeats a rollout), else from a stream seeded with it."""
        ...

    def sync_weights(self, policy: PreTrainedModel) -> None:
        """Make the next `generate` sample from `policy`'s weights as they are now."""
        ...


@contextmanager
def seeded(device: torch.device, seed: int | None) -> Iterator[None]:
    """Draw from a stream seeded with `seed`, leaving the global one untouched; None: the global stream."""
    if seed is None:
        yield
        return
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        yield


def finish_replies(generated: Tensor, params: SamplingParams) -> tuple[Tensor, Tensor, Tensor]:
    """Generated ids ``[B, T]`` -> ids with pad after each stop token, mask and finished (`mask_after_stop`)."""
    mask, finished = mask_after_stop(generated, list(params.stop_ids))
    return torch.where(mask.bool(), generated, params.pad_id), mask, finished


class HFGenerateEngine:
    """Hugging Face `generate` on the policy module itself: the reference engine."""

    def __init__(self, policy: PreTrainedModel) -> None:
        self.policy = policy

    def sync_weights(self, policy: PreTrainedModel) -> None:
        self.policy = policy  # it samples the module itself: nothing to copy

    @torch.no_grad()
    def generate(
        self, prompt_ids: Tensor, prompt_mask: Tensor, params: SamplingParams, seed: int | None = None
    ) -> Generation:
        with seeded(prompt_ids.device, seed):
            ids, mask, finished = generate_responses(
                self.policy, prompt_ids, prompt_mask, params.settings, list(params.stop_ids), params.pad_id
            )
        return Generation(response_ids=ids, response_mask=mask, finished=finished)
