"""Each PPO monitor on a fixed, hand-made batch, against plain loops over the real tokens."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from rlhf_core.models.tiny import load_tiny_model
from rlhf_core.ppo.experience import Experience
from rlhf_core.ppo.monitors import (
    SampleTable,
    experience_monitors,
    reward_length_monitor,
    sample_rows,
    validation_monitors,
)
from rlhf_core.ppo.plots import critic_pretraining_steps, curve, plot_figure_4

MASK = [[1, 1, 1], [1, 1, 0]]
LOGPROBS = [[-1.0, -2.0, -0.5], [-3.0, -0.1, 0.0]]
REF_LOGPROBS = [[-1.2, -1.5, -0.5], [-2.0, -0.4, 0.0]]
ENTROPY = [[2.0, 1.0, 0.5], [3.0, 2.5, 0.0]]
VALUES = [[0.1, 0.2, 0.3], [-0.5, 0.4, 0.0]]
ADVANTAGES = [[0.5, -0.2, 1.0], [0.3, 0.9, 0.0]]
RETURNS = [[0.7, 0.1, 1.2], [-0.1, 1.4, 0.0]]
REWARDS = [[0.01, -0.02, 1.5], [0.03, -0.8, 0.0]]
SCORES = [1.5, -0.5]
PROCESSED = [1.0, -1.0]
FINISHED = [True, False]


def fixed_experience() -> Experience:
    t = torch.tensor
    return Experience(
        prompt_ids=t([[0, 7, 8], [9, 10, 11]]),
        prompt_mask=t([[0, 1, 1], [1, 1, 1]]),
        response_ids=t([[20, 21, 2], [22, 23, 2]]),
        response_mask=t(MASK),
        finished=t(FINISHED),
        logprobs=t(LOGPROBS),
        ref_logprobs=t(REF_LOGPROBS),
        entropy=t(ENTROPY),
        values=t(VALUES),
        scores=t(SCORES),
        processed_scores=t(PROCESSED),
        kl=t(LOGPROBS) - t(REF_LOGPROBS),
        rewards=t(REWARDS),
        advantages=t(ADVANTAGES),
        returns=t(RETURNS),
    )


def real(rows: list[list[float]]) -> list[list[float]]:
    """The real entries of each row (per MASK)."""
    return [[x for x, m in zip(row, mask) if m] for row, mask in zip(rows, MASK)]


def flat(rows: list[list[float]]) -> np.ndarray:
    return np.array([x for row in real(rows) for x in row])


def test_experience_monitors_match_loops() -> None:
    metrics = experience_monitors(fixed_experience())
    k1 = [[p - r for p, r in zip(prow, rrow)] for prow, rrow in zip(real(LOGPROBS), real(REF_LOGPROBS))]
    k3 = [
        [math.expm1(r - p) - (r - p) for p, r in zip(prow, rrow)]
        for prow, rrow in zip(real(LOGPROBS), real(REF_LOGPROBS))
    ]
    lengths = np.array([3.0, 2.0])
    returns, values = flat(RETURNS), flat(VALUES)
    expected = {
        "reward/score_mean": np.mean(SCORES),
        "reward/score_std": np.std(SCORES),
        "reward/processed_mean": np.mean(PROCESSED),
        "reward/processed_std": np.std(PROCESSED),
        "reward/total_mean": np.mean([sum(row) for row in real(REWARDS)]),
        "kl/token_k1": np.mean([x for row in k1 for x in row]),
        "kl/token_k3": np.mean([x for row in k3 for x in row]),
        "kl/sequence_k1": np.mean([sum(row) for row in k1]),
        "kl/sequence_k3": np.mean([sum(row) for row in k3]),
        "perplexity/policy": math.exp(-flat(LOGPROBS).mean()),
        "perplexity/reference": math.exp(-flat(REF_LOGPROBS).mean()),
        "response/length_mean": lengths.mean(),
        "response/length_std": lengths.std(),
        "response/finished_fraction": 0.5,
        "policy/entropy": flat(ENTROPY).mean(),
        "advantages/mean": flat(ADVANTAGES).mean(),
        "advantages/std": flat(ADVANTAGES).std(),
        "returns/mean": returns.mean(),
        "returns/std": returns.std(),
        "values/mean": values.mean(),
        "values/explained_variance": 1 - np.var(returns - values) / np.var(returns),
    }
    assert set(metrics) == set(expected)
    for name, value in expected.items():
        assert metrics[name] == pytest.approx(float(value), rel=1e-5, abs=1e-6), name


def test_reward_length_monitor_ranks_scores_against_reply_lengths() -> None:
    # Reply lengths without the end-of-turn token: 3 - 1, 4, 1 - 1, 5 - 1, 2 -> 2, 4, 0, 4, 2 (ties average).
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]])
    finished = torch.tensor([True, False, True, True, False])
    scores = torch.tensor([0.5, 2.0, -1.0, 1.0, 0.7])
    score_ranks, length_ranks = np.array([2.0, 5.0, 1.0, 4.0, 3.0]), np.array([2.5, 4.5, 1.0, 4.5, 2.5])
    expected = np.corrcoef(score_ranks, length_ranks)[0, 1]
    assert reward_length_monitor(scores, mask, finished) == {"reward/length_spearman": pytest.approx(expected)}
    # The fixed batch's two replies both have 2 tokens: no correlation to speak of, so none is logged.
    assert reward_length_monitor(torch.tensor(SCORES), torch.tensor(MASK), torch.tensor(FINISHED)) == {}


def test_validation_monitors_match_loops() -> None:
    experience = fixed_experience()
    rewards = experience.scores - 1.0
    metrics = validation_monitors(
        rewards,
        experience.scores,
        experience.finished,
        experience.logprobs,
        experience.ref_logprobs,
        experience.response_mask,
    )
    k3 = [math.expm1(r - p) - (r - p) for p, r in zip(flat(LOGPROBS), flat(REF_LOGPROBS))]
    expected = {
        "val/reward": np.mean(SCORES) - 1.0,
        "val/reward_std": np.std(SCORES),
        "val/score": np.mean(SCORES),
        "val/prompts": len(SCORES),
        "val/kl": np.mean(k3),
        "val/kl_k1": np.mean(flat(LOGPROBS) - flat(REF_LOGPROBS)),
        "val/perplexity": math.exp(-flat(LOGPROBS).mean()),
        "val/reference_perplexity": math.exp(-flat(REF_LOGPROBS).mean()),
        "val/length": 2.5,
        "val/finished_fraction": 0.5,
    }
    assert set(metrics) == set(expected)
    for name, value in expected.items():
        assert metrics[name] == pytest.approx(float(value), rel=1e-5, abs=1e-6), name


def test_padding_never_leaks_into_a_monitor() -> None:
    experience = fixed_experience()
    poisoned = {
        name: getattr(experience, name).clone()
        for name in ("logprobs", "ref_logprobs", "entropy", "values", "advantages", "returns", "rewards")
    }
    for tensor in poisoned.values():
        tensor[1, 2] = float("nan")
    clean = experience_monitors(experience)
    dirty = experience_monitors(Experience(**{**experience.__dict__, **poisoned}))
    assert dirty == pytest.approx(clean)


def test_sample_rows_decode_real_tokens_only() -> None:
    tokenizer = load_tiny_model()[1]
    experience = fixed_experience()
    rows = sample_rows(experience, tokenizer, limit=5)
    assert len(rows) == 2
    assert rows[0]["prompt"] == tokenizer.decode([7, 8])
    assert rows[1]["response"] == tokenizer.decode([22, 23])
    assert (rows[1]["score"], rows[1]["processed_score"], rows[1]["finished"], rows[1]["length"]) == (
        -0.5,
        -1.0,
        False,
        2,
    )


def test_sample_table_rewinds_with_the_history(tmp_path: Path) -> None:
    table = SampleTable(tmp_path / "samples.jsonl")
    table.write(1, [{"prompt": "a", "response": "b"}])
    table.write(2, [{"prompt": "c", "response": "d"}, {"prompt": "e", "response": "f"}])
    table.truncate_after(1)
    table.write(2, [{"prompt": "g", "response": "h"}])
    table.close()
    lines = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert lines == [{"step": 1, "prompt": "a", "response": "b"}, {"step": 2, "prompt": "g", "response": "h"}]


def test_figure_4_panels_are_drawn_from_the_history(tmp_path: Path) -> None:
    history = [
        {"step": 0, "val/reward": 0.5, "val/kl": 0.0},
        {"step": 1, "policy/updating": 0.0, "reward/score_mean": 0.4, "kl/token_k3": 0.0},
        {"step": 2, "policy/updating": 1.0, "reward/score_mean": float("nan"), "kl/token_k3": 0.1},
        {"step": 3, "policy/updating": 1.0, "reward/score_mean": 0.7, "val/reward": 0.6},
    ]
    assert curve(history, "reward/score_mean") == ([1, 3], [0.4, 0.7])  # missing and non-finite skipped
    assert curve(history, "val/reward") == ([0, 3], [0.5, 0.6])
    assert critic_pretraining_steps(history) == [1]
    paths = plot_figure_4(history, tmp_path / "plots")
    assert [path.name for path in paths] == ["reward.png", "kl.png", "perplexity.png", "response_length.png"]
    assert all(path.read_bytes()[:4] == b"\x89PNG" for path in paths)
