"""Rollouts: batched sampling of responses, and the no-grad passes that judge them (paper section 5).

Layout (see `experience.py`): prompts are LEFT-padded to a common width P, so one batched, KV-cached
`generate` call continues every prompt at column P; responses come back RIGHT-padded to width T.
Every forward pass below runs the model on the concatenation ``[prompt | response]`` with position
ids counted over real tokens only (`heads.final_hidden_states`), so a row's outputs do not depend on
how much padding its batch needed; columns that are padding in every row of a (micro-)batch are
dropped before the pass (`sequences.joined_sequence`) and the outputs padded back to the batch's width.
Each pass can start from the residual stream of the frozen lower blocks the four PPO models share
(`trunk`, shared_trunk.py), computed once per rollout; then only the model's upper blocks run.

Log-probs: the token ``response[:, t]`` was sampled from the distribution the model gave at the
position before it, ``P + t - 1``. Only those T positions ever need the LM head, so the backbone
runs on the whole sequence and the ``[hidden, vocab]`` projection is applied to the response slice
alone (the prompt's logits would cost ``P / T`` times more memory and time for nothing). Log-probs
use the sampling temperature: the importance ratio and the KL to the reference must be measured on
the distribution that generated the data.

Sampling: rollouts default to temperature-only sampling, so the sampling distribution IS the
temperature-scaled policy and PPO stays on-policy. Nucleus sampling (`top_p` < 1) and a repetition
penalty (the paper's p = 0.9, 1.1) change the sampling distribution without changing the log-probs
PPO computes, which makes the rollout off-policy; they are options, documented as such.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import GenerationConfig as HFGenerationConfig
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from rlhf_core.config import GenerationConfig
from rlhf_core.models.chat import end_of_turn_id
from rlhf_core.models.heads import Critic, RewardModel
from rlhf_core.ppo.losses import at_least_float32, entropy_from_logits, logprobs_from_logits, tempered
from rlhf_core.ppo.sequences import TrunkStates, joined_hidden_states, joined_sequence


class Scorer(Protocol):
    """Anything that scores responses: the reward model in the stage, a rule in tests.

    Takes the rollout layout (prompt ``[B, P]`` left-padded, response ``[B, T]`` right-padded, with
    their masks) and returns one float score per response, ``[B]``.
    """

    def __call__(
        self, prompt_ids: Tensor, prompt_mask: Tensor, response_ids: Tensor, response_mask: Tensor
    ) -> Tensor: ...


class RewardModelScorer:
    """The reward model as a `Scorer`: r(x, y) read at the reply's end-of-turn token (paper eq. 1).

    `RewardModel.forward` finds that token with `chat.reply_end_positions`, the same function the
    reward model was trained with; the reply starts at column P, so end-of-turn tokens inside the
    prompt and padding (SmolLM2 pads with its end-of-turn token) are never read. Rows are scored
    `micro_batch_size` at a time to bound memory.
    """

    def __init__(self, reward_model: RewardModel, micro_batch_size: int) -> None:
        self.reward_model = reward_model
        self.micro_batch_size = micro_batch_size

    def __call__(
        self, prompt_ids: Tensor, prompt_mask: Tensor, response_ids: Tensor, response_mask: Tensor
    ) -> Tensor:
        return self.score(prompt_ids, prompt_mask, response_ids, response_mask, trunk=None)

    @torch.no_grad()
    def score(
        self,
        prompt_ids: Tensor,
        prompt_mask: Tensor,
        response_ids: Tensor,
        response_mask: Tensor,
        trunk: TrunkStates | None,
    ) -> Tensor:
        """Scores ``[B]``; with `trunk` (the same rows' shared lower blocks) only the upper blocks run."""
        scores = []
        for rows in chunks(prompt_ids.shape[0], self.micro_batch_size):
            joined = joined_sequence(prompt_ids[rows], prompt_mask[rows], response_ids[rows], response_mask[rows])
            part = trunk.select(rows) if trunk is not None else None
            hidden = joined_hidden_states(self.reward_model.backbone, joined, part)
            scores.append(
                self.reward_model.scores_from_hidden(
                    hidden, joined.input_ids, joined.attention_mask, reply_start=joined.prompt_width
                )
            )
        return at_least_float32(torch.cat(scores))


def chunks(batch_size: int, chunk_size: int) -> list[slice]:
    """Consecutive row slices of at most `chunk_size` covering `batch_size` rows."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    return [slice(start, min(start + chunk_size, batch_size)) for start in range(0, batch_size, chunk_size)]


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
        input_ids=prompt_ids,
        attention_mask=prompt_mask,
        generation_config=sampling_config(settings, stop_ids, pad_id),
    )
    response_ids = output[:, prompt_ids.shape[1] :]
    mask, finished = mask_after_stop(response_ids, stop_ids)
    return torch.where(mask.bool(), response_ids, pad_id), mask, finished


def _pad_to(x: Tensor, length: int) -> Tensor:
    """Right-pad a ``[B, T']`` tensor with zeros to ``[B, length]``."""
    return F.pad(x, (0, length - x.shape[1]))


def response_logprobs(
    lm: PreTrainedModel,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    response_ids: Tensor,
    response_mask: Tensor,
    temperature: float,
    with_entropy: bool = False,
    trunk: TrunkStates | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Log-probs ``[B, T]`` of the response tokens under `lm` at `temperature` (0 on padding).

    With `with_entropy`, also the entropy ``[B, T]`` of ``softmax(logits / temperature)`` at each
    response position (0 on padding), else None. Gradients flow when called with grad enabled (the
    PPO update); rollouts call it under `torch.no_grad()`. The LM head sees only the T positions
    that predict response tokens (module docstring); that assumes a plain linear head, as in Llama
    and SmolLM2 (no logit soft-capping or scaling). With `trunk` (the same rows' residual stream
    after the frozen lower blocks `lm` shares) only `lm`'s upper blocks run.
    """
    joined = joined_sequence(prompt_ids, prompt_mask, response_ids, response_mask)
    width, length = joined.prompt_width, joined.response_length
    hidden = joined_hidden_states(lm.base_model, joined, trunk)
    # contiguous: the LM head then runs as one matrix product over all B x T rows, not a batched one per
    # row over a broadcast weight (bit-identical logits, 1.4-1.6x faster on a CPU; docs/rollout-engine.md)
    logits = lm.get_output_embeddings()(hidden[:, width - 1 : width + length - 1].contiguous())
    real = response_mask[:, :length].bool()
    logprobs = torch.where(real, logprobs_from_logits(logits, response_ids[:, :length], temperature), 0.0)
    full_length = response_ids.shape[1]
    if not with_entropy:
        return _pad_to(logprobs, full_length), None
    entropy = torch.where(real, entropy_from_logits(tempered(logits, temperature)), 0.0)
    return _pad_to(logprobs, full_length), _pad_to(entropy, full_length)


def response_values(
    critic: Critic,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    response_ids: Tensor,
    response_mask: Tensor,
    trunk: TrunkStates | None = None,
) -> Tensor:
    """Critic values ``[B, T]`` (at least float32, 0 on padding): V(s_t) is read at position ``P + t - 1``.

    State s_t is the prompt plus the first t response tokens, whose last token sits at column
    ``P + t - 1`` (for t = 0, the prompt's last token): the same position whose logits sampled
    ``response[:, t]``. With `trunk`, only the critic's upper blocks run (as in `response_logprobs`).
    """
    joined = joined_sequence(prompt_ids, prompt_mask, response_ids, response_mask)
    width, length = joined.prompt_width, joined.response_length
    hidden = joined_hidden_states(critic.backbone, joined, trunk)
    values = at_least_float32(critic.values_from_hidden(hidden)[:, width - 1 : width + length - 1])
    return _pad_to(torch.where(response_mask[:, :length].bool(), values, 0.0), response_ids.shape[1])
