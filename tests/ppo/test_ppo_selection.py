"""Choosing the output policy: paired differences against plain arithmetic, and the rule on synthetic,
noisy validation curves (noise alone keeps the latest in-bound policy; a real drop goes back)."""

from __future__ import annotations

import math
import random
import statistics

import pytest

from rlhf_core.ppo.selection import ValidationRecord, paired_difference, select_policy

PROMPTS = 64
STEPS = (0, 8, 16, 24, 32)


def curve(
    rng: random.Random, true_means: dict[int, float], kls: dict[int, float] | None = None
) -> list[ValidationRecord]:
    """Validations of one run: per-prompt rewards = prompt difficulty (shared, paired) + the step's true
    mean + sampling noise; the prompt effect is three times the noise, as on held-out RM scores."""
    difficulty = [rng.gauss(0.0, 0.9) for _ in range(PROMPTS)]
    return [
        ValidationRecord(
            step=step,
            kl=(kls or {}).get(step, 0.01 * step / 8),
            rewards=tuple(d + true_means[step] + rng.gauss(0.0, 0.3) for d in difficulty),
        )
        for step in STEPS
    ]


def test_paired_difference_matches_plain_arithmetic() -> None:
    a, b = [1.0, 2.5, -0.5, 4.0, 0.0], [0.5, 2.0, -1.5, 3.0, 0.25]
    differences = [x - y for x, y in zip(a, b)]
    se = statistics.stdev(differences) / math.sqrt(len(differences))
    result = paired_difference(a, b)
    assert result.mean == pytest.approx(statistics.mean(differences))
    assert result.standard_error == pytest.approx(se)
    assert (result.low, result.high) == pytest.approx((result.mean - 1.96 * se, result.mean + 1.96 * se), abs=1e-3)
    assert result.prompts == 5


def test_noise_alone_keeps_the_latest_policy_within_the_bound() -> None:
    rng = random.Random(0)
    runs = [curve(rng, {step: 0.0 for step in STEPS}) for _ in range(200)]
    kept_latest = sum(select_policy(records, max_kl=0.5).step == STEPS[-1] for records in runs)
    # going back needs an earlier policy to win by 2 paired SEs (a one-sided 2.3% fluke each, 4 chances);
    # a strict "highest mean" rule keeps the latest of 5 equal policies only a fifth of the time
    strict = sum(max(records, key=lambda r: statistics.mean(r.rewards)).step == STEPS[-1] for records in runs)
    assert kept_latest >= 180 and strict < 80


def test_a_real_drop_goes_back_to_the_best_earlier_policy() -> None:
    rng = random.Random(1)
    records = curve(rng, {0: 0.0, 8: 0.3, 16: 0.6, 24: 0.2, 32: -0.4})
    selection = select_policy(records, max_kl=0.5)
    assert selection.step == 16
    assert "step 16 beats the latest policy" in selection.reason
    assert selection.versus_initial.low > 0


def test_a_steady_gain_keeps_the_latest_and_reports_its_gain_over_the_start() -> None:
    rng = random.Random(2)
    records = curve(rng, {0: 0.0, 8: 0.1, 16: 0.2, 24: 0.3, 32: 0.4})
    selection = select_policy(records, max_kl=0.5)
    assert selection.step == 32 and selection.reason.startswith("latest policy within the KL bound")
    gain = selection.versus_initial
    assert gain.low < 0.4 < gain.high and gain.low > 0


def test_policies_beyond_the_kl_bound_are_never_chosen() -> None:
    rng = random.Random(3)
    records = curve(rng, {0: 0.0, 8: 0.2, 16: 0.4, 24: 0.6, 32: 0.8}, kls={24: 0.6, 32: 0.7})
    assert select_policy(records, max_kl=0.5).step == 16
    assert select_policy(records, max_kl=None).step == 32


def test_the_initial_validation_is_required() -> None:
    with pytest.raises(ValueError, match="step 0"):
        select_policy([ValidationRecord(step=8, kl=0.0, rewards=(1.0, 2.0))], max_kl=0.5)
    with pytest.raises(ValueError, match="equal"):
        paired_difference([1.0], [1.0, 2.0])


def test_records_survive_a_checkpoint_round_trip() -> None:
    record = ValidationRecord(step=8, kl=0.02, rewards=(0.5, -1.25))
    assert ValidationRecord.from_dict(record.to_dict()) == record
