"""The lean rollout engine: a plain sampling loop over `llama_decoder`, without `generate`'s machinery.

Per rollout: one prefill of the left-padded prompts into a preallocated KV cache (llama_decoder.py), then
one decode step per reply token, each a single-row-per-prompt forward through the engine's own copy of the
weights (decode_weights.py): in C with the blocked layout (decode_step.py, around the C kernel of
blocked_linear.py), else in PyTorch (llama_decoder.py, oneDNN's reordered layout).
Sampling repeats `generate`'s: the same logits processors in the same order (transformers' repetition
penalty, temperature and top-p classes, each only when switched on), ``softmax``
to the ``[B, vocab]`` float32 probabilities, one draw per row from torch's global generator
(`ppo.rollout.sampler`, sampling.py), a finished row's token replaced by the pad id, a stop once every
row has emitted a stop id or the length cap is reached. With the `multinomial` sampler, float32 weights
and the same random state it draws the same tokens as `HFGenerateEngine`
(tests/models/test_rollout_engine.py), up to the float32 rounding of a different matmul kernel
(docs/rollout-engine.md measures it); the default `inverse_cdf` sampler draws from the same distribution
with other random numbers, at a thirtieth of the cost.

On-policy: PPO's behaviour log-probs are never the engine's. The experience maker recomputes them in its
float32 scoring pass over the sampled tokens (`response_logprobs`), the same pass the update's new
log-probs come from. With float32 weights the engine samples that very distribution; with
`ppo.rollout.dtype: bfloat16` it samples a bf16 rounding of it, which makes PPO slightly off-policy: the
engine reports its own log-probs (`Generation.logprobs`) and the trainer logs their gap to the scoring
pass's as `rollout/engine_logprob_gap` (docs/rollout-engine.md has the measured size). bf16 is off by
default.
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers import PreTrainedModel
from transformers.generation.logits_process import (
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopPLogitsWarper,
)

from rlhf_core.config.generation import GenerationConfig, RolloutConfig
from rlhf_core.rollout.decode_step import DecodeStep, usable
from rlhf_core.rollout.decode_weights import DecoderWeights
from rlhf_core.rollout.engine import Generation, SamplingParams, finish_replies, seeded
from rlhf_core.rollout.llama_decoder import Capture, KVCache, Positions, TorchStep, next_token_logits
from rlhf_core.rollout.sampling import draw

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def logits_processors(settings: GenerationConfig) -> LogitsProcessorList:
    """The processors `generate` applies for these settings, in its order (none for pure temperature 1)."""
    processors = LogitsProcessorList()
    if settings.repetition_penalty != 1.0:
        processors.append(RepetitionPenaltyLogitsProcessor(penalty=settings.repetition_penalty))
    if settings.temperature != 1.0:
        processors.append(TemperatureLogitsWarper(settings.temperature))
    if settings.top_p < 1.0:
        processors.append(TopPLogitsWarper(top_p=settings.top_p))
    return processors


def weights_dtype(settings: RolloutConfig, policy: PreTrainedModel) -> torch.dtype:
    """The dtype `settings.dtype` names; `auto`, which a stage resolves for its precision
    (rlhf_core/stages/precision.py), is bfloat16 for a bfloat16 policy and float32 for any other when the
    engine is used directly (the engine computes in those two only)."""
    if settings.dtype == "auto":
        return torch.bfloat16 if next(policy.parameters()).dtype == torch.bfloat16 else torch.float32
    return DTYPES[settings.dtype]


class LeanEngine:
    """Samples from its own copy of the policy's weights (`DecoderWeights`), refreshed by `sync_weights`.

    With `trunk_layers` (the shared trunk's `num_lower`) each `Generation` also carries the residual
    stream entering that block at every column, so the scoring passes need not recompute it; only asked
    for when the engine computes in the policy's own dtype (float32), so the states are the policy's.
    """

    def __init__(
        self, policy: PreTrainedModel, settings: RolloutConfig, rollout_batch_size: int, trunk_layers: int | None = None
    ) -> None:
        self.dtype = weights_dtype(settings, policy)
        self.weights = DecoderWeights(policy, self.dtype, rows=rollout_batch_size, kernel=settings.kernel)
        self.trunk_layers = trunk_layers

    def sync_weights(self, policy: PreTrainedModel) -> None:
        self.weights.refresh(policy)

    @torch.no_grad()
    def generate(
        self, prompt_ids: Tensor, prompt_mask: Tensor, params: SamplingParams, seed: int | None = None
    ) -> Generation:
        batch, width = prompt_ids.shape
        limit = params.settings.max_new_tokens
        capture = None
        if self.trunk_layers is not None:
            residual = prompt_ids.new_empty((batch, width + limit, self.weights.embedding.shape[1]), dtype=self.dtype)
            capture = Capture(self.trunk_layers, residual)
        with seeded(prompt_ids.device, seed):
            generated, logprobs = self._sample(prompt_ids, prompt_mask, params, capture)
        ids, mask, finished = finish_replies(generated, params)
        return Generation(
            response_ids=ids,
            response_mask=mask,
            finished=finished,
            logprobs=torch.where(mask.bool(), logprobs, 0.0),
            trunk_residual=capture.residual[:, : width + ids.shape[1]] if capture is not None else None,
        )

    def _sample(
        self, prompt_ids: Tensor, prompt_mask: Tensor, params: SamplingParams, capture: Capture | None
    ) -> tuple[Tensor, Tensor]:
        """Generated ids ``[B, T]`` (pad once a row has finished) and their sampling log-probs ``[B, T]``.

        With `capture`, the last sampled token also runs through the captured blocks (it is never fed
        back for a next token), so that every column's residual is filled.
        """
        batch, width = prompt_ids.shape
        limit = params.settings.max_new_tokens
        processors = logits_processors(params.settings)
        stops = torch.tensor(params.stop_ids, dtype=torch.long, device=prompt_ids.device)
        cache = KVCache.allocate(self.weights, batch, width + limit)
        positions = Positions.for_rollout(self.weights, prompt_mask, limit)
        ids = torch.cat([prompt_ids, prompt_ids.new_full((batch, limit), params.pad_id)], dim=1)
        logprobs = torch.zeros(batch, limit, device=prompt_ids.device)
        unfinished = torch.ones(batch, dtype=torch.bool, device=prompt_ids.device)
        logits = next_token_logits(self.weights, prompt_ids, cache, 0, positions, capture)
        step = (DecodeStep if usable(self.weights) else TorchStep)(self.weights, cache, positions, capture)
        steps = 0
        while steps < limit:
            scores = processors(ids[:, : width + steps], logits)
            token = draw(torch.softmax(scores, dim=-1), params.settings.sampler)
            if len(params.stop_ids):
                token = torch.where(unfinished, token, params.pad_id)
            ids[:, width + steps] = token
            logprobs[:, steps] = torch.log_softmax(scores, dim=-1).gather(1, token[:, None]).squeeze(1)
            if len(params.stop_ids):
                unfinished &= ~torch.isin(token, stops)
            steps += 1
            if steps == limit or not bool(unfinished.any()):
                break
            logits = step.logits(token, width + steps - 1)
        if capture is not None:
            step.lower_blocks(token, width + steps - 1, stop=capture.layer)
        return ids[:, width : width + steps], logprobs[:, :steps]
