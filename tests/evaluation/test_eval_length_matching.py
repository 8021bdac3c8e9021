"""Length-matched pairs: the closest-length choice against a brute-force reference, judge-blindness, the
similar-length filter, and several seeded replies per prompt from the tiny model."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from rlhf_core.config import RolloutConfig
from rlhf_core.evaluation.generation import Reply, generate_replies, sample_replies
from rlhf_core.evaluation.length_matching import closest_length_pair, length_matched_pairs
from rlhf_core.evaluation.outputs import matched_generation_rows
from rlhf_core.evaluation.prompts import EvalPrompt
from rlhf_core.models.tiny import build_tiny_model

GENERATION = RolloutConfig(max_new_tokens=6, temperature=0.8, top_p=0.9, repetition_penalty=1.1)


def replies(*tokens: int, text: str = "reply") -> list[Reply]:
    return [Reply(text=f"{text} {i}", tokens=count, finished=True) for i, count in enumerate(tokens)]


def prompt(index: int) -> EvalPrompt:
    return EvalPrompt(f"p{index}", ({"role": "user", "content": f"Question {index}?"},), "An answer.", "test")


def test_the_closest_pair_matches_brute_force() -> None:
    rng = np.random.default_rng(0)
    for _ in range(200):
        tokens_a = rng.integers(0, 30, rng.integers(1, 5)).tolist()
        tokens_b = rng.integers(0, 30, rng.integers(1, 5)).tolist()
        pairs = list(itertools.product(range(len(tokens_a)), range(len(tokens_b))))
        gap = min(abs(tokens_a[i] - tokens_b[j]) for i, j in pairs)
        first = next((i, j) for i, j in pairs if abs(tokens_a[i] - tokens_b[j]) == gap)
        assert closest_length_pair(tokens_a, tokens_b) == first
    with pytest.raises(ValueError, match="at least one"):
        closest_length_pair([], [3])


def test_pairs_are_chosen_by_length_alone_and_kept_when_similar() -> None:
    prompts = [prompt(i) for i in range(3)]
    samples_a = [replies(30, 12, 50), replies(40, 41), replies(8, 9)]
    samples_b = [replies(60, 11, 13), replies(10, 90), replies(20, 30)]
    matched = length_matched_pairs(prompts, samples_a, samples_b)
    # prompt 0: 12 vs 11 (gap 1, within 20%); prompt 1: 40 vs 10 is too far apart; prompt 2: 9 vs 20 too
    assert [(pair.prompt.prompt_id, pair.sample_a, pair.sample_b) for pair in matched] == [("p0", 1, 1)]
    # judge-blind: other texts with the same lengths give the same choice
    other_texts = [replies(*(r.tokens for r in group), text="other") for group in samples_a]
    again = length_matched_pairs(prompts, other_texts, samples_b)
    assert [(p.sample_a, p.sample_b) for p in again] == [(p.sample_a, p.sample_b) for p in matched]

    (row,) = matched_generation_rows(matched)
    assert (row["reply_a"], row["tokens_a"], row["tokens_b"], row["sample_a"], row["sample_b"]) == (
        "reply 1",
        12,
        11,
        1,
        1,
    )
    with pytest.raises(ValueError, match="prompts"):
        length_matched_pairs(prompts, samples_a[:2], samples_b)


def test_sample_replies_gives_seeded_replies_per_prompt(tokenizer) -> None:
    model = build_tiny_model(tokenizer, seed=0)
    messages = [({"role": "user", "content": f"Question {i}?"},) for i in range(3)]
    samples = sample_replies(model, tokenizer, messages, GENERATION, batch_size=4, seed=5, samples=3)
    assert [len(group) for group in samples] == [3, 3, 3]
    assert samples == sample_replies(model, tokenizer, messages, GENERATION, batch_size=4, seed=5, samples=3)
    flat = generate_replies(model, tokenizer, [m for m in messages for _ in range(3)], GENERATION, 4, seed=5)
    assert [reply for group in samples for reply in group] == flat
    with pytest.raises(ValueError, match="samples"):
        sample_replies(model, tokenizer, messages, GENERATION, batch_size=4, seed=5, samples=0)
