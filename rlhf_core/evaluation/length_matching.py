"""Length-matched pairs, drawn judge-blind (docs/evaluation.md).

A judge that prefers long (or short) replies can make a model look better than it is; comparing only
pairs of similar length takes that lever away. The main replies rarely have similar lengths once PPO
has moved the policy's length, so the evaluation samples `evaluation.length_matched_samples` replies
per prompt and model (the first is the main reply) and, per prompt, pairs the closest-length reply of
A with one of B. The pair is kept when |len_A - len_B| <= `SIMILAR_LENGTH_RATIO` * max(len_A, len_B).

The choice looks at token counts only, before any judge sees a reply, so it cannot favour either model
by quality; ties between equally close pairs go to the lowest sample indices (the main replies first).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rlhf_core.evaluation.generation import Reply
from rlhf_core.evaluation.prompts import EvalPrompt
from rlhf_core.evaluation.report import SIMILAR_LENGTH_RATIO, is_similar_length


@dataclass(frozen=True)
class MatchedPair:
    """The length-matched pair of one prompt: which sample of each model, and the two replies."""

    prompt: EvalPrompt
    sample_a: int
    sample_b: int
    reply_a: Reply
    reply_b: Reply


def closest_length_pair(tokens_a: Sequence[int], tokens_b: Sequence[int]) -> tuple[int, int]:
    """Indices (i, j) minimising |tokens_a[i] - tokens_b[j]|, the lowest (i, j) among equally close pairs."""
    if not tokens_a or not tokens_b:
        raise ValueError("closest_length_pair needs at least one reply of each model")
    return min(
        ((i, j) for i in range(len(tokens_a)) for j in range(len(tokens_b))),
        key=lambda pair: (abs(tokens_a[pair[0]] - tokens_b[pair[1]]), pair),
    )


def length_matched_pairs(
    prompts: Sequence[EvalPrompt],
    samples_a: Sequence[Sequence[Reply]],
    samples_b: Sequence[Sequence[Reply]],
    ratio: float = SIMILAR_LENGTH_RATIO,
) -> list[MatchedPair]:
    """Per prompt, the closest-length pair of its replies (samples_x[p]: model x's replies to prompt p),
    kept when similar in length within `ratio`; in prompt order."""
    if not len(prompts) == len(samples_a) == len(samples_b):
        raise ValueError(f"{len(prompts)} prompts but replies for {len(samples_a)} and {len(samples_b)}")
    matched = []
    for prompt, replies_a, replies_b in zip(prompts, samples_a, samples_b):
        i, j = closest_length_pair([reply.tokens for reply in replies_a], [reply.tokens for reply in replies_b])
        if is_similar_length(replies_a[i].tokens, replies_b[j].tokens, ratio):
            matched.append(MatchedPair(prompt, i, j, replies_a[i], replies_b[j]))
    return matched
