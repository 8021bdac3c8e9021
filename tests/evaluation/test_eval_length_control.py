"""The length-controlled win rate (AlpacaEval 2.0 style): the fit against plain references, its bootstrap
against a loop that refits each resample, degenerate inputs, and synthetic judges that prefer length
or quality."""

from __future__ import annotations

import math

import numpy as np
import pytest

from rlhf_core.evaluation.length_control import REGULARISATION, AnchorRows, length_controlled_win_rate


def plain_gradient_descent(preferences: np.ndarray, differences: np.ndarray, steps: int = 20_000) -> np.ndarray:
    """(theta, phi) by plain gradient descent on the mean penalised log loss, from (0, 0)."""
    scale = np.std(differences, ddof=1) if len(differences) > 1 else 0.0
    features = np.tanh(differences / scale) if scale > 0 else np.zeros_like(differences)
    params = np.zeros(2)
    count = len(preferences)
    for _ in range(steps):
        probabilities = 1 / (1 + np.exp(-(params[0] + params[1] * features)))
        residual = probabilities - preferences
        gradient = np.array([residual.sum(), (residual * features).sum()]) + REGULARISATION * params
        params -= 2.0 / count * gradient  # step 2 / N: below 1 / L, L <= N / 2 + regularisation
    return params


def synthetic_pairs(seed: int, count: int = 200) -> tuple[np.ndarray, np.ndarray]:
    """Token lengths of A's and B's replies: A is longer on about four pairs in five."""
    rng = np.random.default_rng(seed)
    tokens_a = np.maximum(1, rng.normal(80, 20, count)).round()
    tokens_b = np.maximum(1, rng.normal(50, 20, count)).round()
    return tokens_a, tokens_b


def test_the_fit_matches_plain_gradient_descent() -> None:
    rng = np.random.default_rng(0)
    differences = rng.normal(5, 30, 150).round()
    features = np.tanh(differences / differences.std(ddof=1))
    preferences = (rng.random(150) < 1 / (1 + np.exp(-(0.4 + 1.2 * features)))).astype(float)
    preferences[:20] = 0.5  # some ties
    result = length_controlled_win_rate(preferences, differences, resamples=10, seed=0)
    theta, phi = plain_gradient_descent(preferences, differences)
    assert (result.theta, result.phi) == pytest.approx((theta, phi), abs=1e-6)
    assert result.rate == pytest.approx(1 / (1 + math.exp(-theta)), abs=1e-7)
    assert result.length_scale == pytest.approx(differences.std(ddof=1))
    assert result.pairs == 150


def test_the_fit_matches_scipy() -> None:
    optimize = pytest.importorskip("scipy.optimize")
    tokens_a, tokens_b = synthetic_pairs(seed=4, count=120)
    differences = tokens_a - tokens_b
    rng = np.random.default_rng(4)
    preferences = rng.choice([0.0, 0.5, 1.0], size=120, p=[0.3, 0.2, 0.5])
    features = np.tanh(differences / differences.std(ddof=1))

    def objective(params: np.ndarray) -> float:
        logits = params[0] + params[1] * features
        return float((np.logaddexp(0, logits) - preferences * logits).sum() + REGULARISATION / 2 * params @ params)

    reference = optimize.minimize(objective, np.zeros(2), method="BFGS", options={"gtol": 1e-9}).x
    result = length_controlled_win_rate(preferences, differences, resamples=10)
    assert (result.theta, result.phi) == pytest.approx(tuple(reference), abs=1e-5)


def test_the_bootstrap_matches_refitting_each_resample() -> None:
    rng = np.random.default_rng(1)
    differences = rng.normal(0, 20, 40).round()
    preferences = rng.choice([0.0, 0.5, 1.0], size=40)
    result = length_controlled_win_rate(preferences, differences, confidence=0.9, resamples=300, seed=7)
    draws = np.random.default_rng(7).integers(0, 40, size=(300, 40))
    rates = sorted(length_controlled_win_rate(preferences[row], differences[row], resamples=1).rate for row in draws)
    assert (result.low, result.high) == pytest.approx(tuple(np.quantile(rates, [0.05, 0.95])), abs=1e-7)
    assert result.low <= result.rate <= result.high
    assert length_controlled_win_rate(preferences, differences, resamples=300, seed=7) == (
        length_controlled_win_rate(preferences, differences, resamples=300, seed=7)
    )


def test_pairs_grouped_by_prompt_are_resampled_with_their_prompt() -> None:
    rng = np.random.default_rng(5)
    prompts, per_prompt = 30, 3
    differences = rng.normal(0, 20, prompts * per_prompt).round()
    preferences = rng.choice([0.0, 0.5, 1.0], size=prompts * per_prompt)
    groups = [f"p{index // per_prompt}" for index in range(prompts * per_prompt)]
    result = length_controlled_win_rate(preferences, differences, confidence=0.9, resamples=200, seed=3, groups=groups)
    draws = np.random.default_rng(3).integers(0, prompts, size=(200, prompts))
    rows = [np.concatenate([np.arange(p * per_prompt, (p + 1) * per_prompt) for p in draw]) for draw in draws]
    rates = sorted(length_controlled_win_rate(preferences[row], differences[row], resamples=1).rate for row in rows)
    assert (result.low, result.high) == pytest.approx(tuple(np.quantile(rates, [0.05, 0.95])), abs=1e-7)
    assert (result.pairs, result.prompts) == (90, 30)
    alone = length_controlled_win_rate(preferences, differences, resamples=200, seed=3)
    assert alone == length_controlled_win_rate(preferences, differences, resamples=200, seed=3, groups=range(90))


def test_copies_of_a_pair_do_not_narrow_the_interval() -> None:
    """Four copies of every prompt's one pair hold no more evidence; counted as independent they would."""
    tokens_a, tokens_b = synthetic_pairs(seed=6, count=120)
    preferences = np.random.default_rng(6).choice([0.0, 1.0], size=120, p=[0.4, 0.6])
    once = length_controlled_win_rate(preferences, tokens_a - tokens_b, resamples=1000, seed=0)
    copies = (np.repeat(preferences, 4), np.repeat(tokens_a - tokens_b, 4))
    grouped = length_controlled_win_rate(*copies, resamples=1000, seed=0, groups=np.repeat(np.arange(120), 4))
    independent = length_controlled_win_rate(*copies, resamples=1000, seed=0)
    assert grouped.rate == pytest.approx(once.rate, abs=1e-3)
    assert grouped.high - grouped.low == pytest.approx(once.high - once.low, rel=0.1)
    assert independent.high - independent.low < 0.7 * (once.high - once.low)


def test_more_sampled_pairs_per_prompt_narrow_the_interval_around_the_same_rate() -> None:
    """A quality judge with a per-prompt effect and per-reply noise: four pairs per prompt average the
    replies' noise away, one pair per prompt keeps it."""
    rng = np.random.default_rng(8)
    prompts, per_prompt = 150, 4
    prompt_effect = np.repeat(rng.normal(0.3, 0.5, prompts), per_prompt)
    preferences = (prompt_effect + rng.normal(0, 1.5, prompts * per_prompt) > 0).astype(float)
    differences = rng.normal(0, 25, prompts * per_prompt).round()
    groups = np.repeat(np.arange(prompts), per_prompt)
    first = np.arange(0, prompts * per_prompt, per_prompt)
    one = length_controlled_win_rate(preferences[first], differences[first], resamples=1000, seed=0)
    four = length_controlled_win_rate(preferences, differences, resamples=1000, seed=0, groups=groups)
    assert four.high - four.low < 0.75 * (one.high - one.low)
    assert four.low < preferences.mean() < four.high and four.low > 0.5


@pytest.mark.parametrize("judge_prefers", ["longer", "shorter"])
@pytest.mark.parametrize("noise_seed", [12, 13, 14])
def test_a_pure_length_judge_gives_an_even_length_controlled_rate(judge_prefers: str, noise_seed: int) -> None:
    tokens_a, tokens_b = synthetic_pairs(seed=2)
    differences = tokens_a - tokens_b
    noise = np.random.default_rng(noise_seed).normal(0, 30, len(differences))  # as wide as the differences
    sign = 1 if judge_prefers == "longer" else -1
    preferences = (sign * differences + noise > 0).astype(float)  # length alone (and noise) decides
    raw = preferences.mean()
    result = length_controlled_win_rate(preferences, differences, resamples=1000, seed=0)
    assert abs(raw - 0.5) > 0.2  # the raw rate says A is far better (or worse)
    assert result.rate == pytest.approx(0.5, abs=0.12)
    assert result.low <= 0.5 <= result.high
    assert sign * result.phi > 1  # the length term took the preference


def test_a_quality_judge_independent_of_length_keeps_the_raw_rate() -> None:
    tokens_a, tokens_b = synthetic_pairs(seed=3)
    rng = np.random.default_rng(13)
    preferences = rng.choice([0.0, 0.5, 1.0], size=len(tokens_a), p=[0.2, 0.1, 0.7])  # A is better, length aside
    result = length_controlled_win_rate(preferences, tokens_a - tokens_b, resamples=1000, seed=0)
    assert result.rate == pytest.approx(preferences.mean(), abs=0.05)
    assert result.low < preferences.mean() < result.high
    assert result.low > 0.5


def test_degenerate_inputs_give_finite_rates() -> None:
    differences = np.arange(-20, 20, dtype=float)
    ties = length_controlled_win_rate(np.full(40, 0.5), differences, resamples=200)
    assert (ties.rate, ties.low, ties.high, ties.theta, ties.phi) == (0.5, 0.5, 0.5, 0.0, 0.0)

    wins = length_controlled_win_rate(np.ones(40), differences, resamples=200)
    losses = length_controlled_win_rate(np.zeros(40), differences, resamples=200)
    assert 0.99 < wins.low <= wins.rate <= wins.high < 1
    assert losses.rate == pytest.approx(1 - wins.rate) and 0 < losses.rate < 0.01

    same_length = length_controlled_win_rate([1.0, 0.0, 1.0, 1.0], [3, 3, 3, 3], resamples=200)
    assert same_length.length_scale == 0 and same_length.phi == 0
    assert same_length.rate == pytest.approx(0.75, abs=0.01)  # the plain rate, barely shrunk by the penalty

    single = length_controlled_win_rate([1.0], [7], resamples=50)
    assert single.low == single.rate == single.high and 0.5 < single.rate < 1
    for result in (ties, wins, losses, same_length, single):
        assert all(math.isfinite(value) for value in result.model_dump().values() if isinstance(value, float))


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match="non-empty"):
        length_controlled_win_rate([], [])
    with pytest.raises(ValueError, match="one length"):
        length_controlled_win_rate([1.0, 0.0], [3])
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        length_controlled_win_rate([2.0], [3])
    with pytest.raises(ValueError, match="resamples"):
        length_controlled_win_rate([1.0], [3], resamples=0)
    with pytest.raises(ValueError, match="2 groups for 3"):
        length_controlled_win_rate([1.0, 0.0, 1.0], [3, 1, 2], groups=["a", "b"])


# ---- anchor rows: the baseline against itself pins the judge's length preference


PROMPTS, SAMPLES = 166, 4  # the default run's evaluation: 166 prompts, 4 replies per prompt and model


def baseline_lengths(seed: int) -> np.ndarray:
    """[prompts, samples]: the token lengths of the baseline's sampled replies (about 80, spread 35%)."""
    return np.maximum(5, np.random.default_rng(seed).lognormal(np.log(80), 0.35, (PROMPTS, SAMPLES))).round()


def verdicts(rng: np.random.Generator, score_a: np.ndarray, score_b: np.ndarray) -> np.ndarray:
    """A judge's preference for A (1, 0.5 on equal scores, 0) from the replies' scores plus unit noise."""
    a, b = score_a + rng.normal(size=score_a.shape), score_b + rng.normal(size=score_b.shape)
    return np.where(a > b, 1.0, np.where(a < b, 0.0, 0.5))


def controlled(
    tokens_a: np.ndarray, lengths: np.ndarray, score, quality: float = 0.0, seed: int = 0, anchored: bool = True
):
    """The length-controlled win rate of A (tokens_a [prompts, samples], each pair against the baseline's
    reply of the same index) over the baseline, judged by `score(tokens)` plus `quality` for A, with
    anchor rows of the baseline's i-th reply against its (i+1)-th judged by the same judge."""
    rng = np.random.default_rng(seed)
    preferences = verdicts(rng, score(tokens_a) + quality, score(lengths)).ravel()
    groups = np.repeat(np.arange(PROMPTS), SAMPLES)
    first, second = lengths[:, :-1], lengths[:, 1:]
    anchors = AnchorRows(
        verdicts(rng, score(first), score(second)).ravel(),
        (first - second).ravel(),
        list(np.repeat(np.arange(PROMPTS), SAMPLES - 1)),
        min_reaching=30,
        min_informative=60,
    )
    differences = (tokens_a - lengths).ravel()
    return length_controlled_win_rate(
        preferences, differences, resamples=500, seed=0, groups=groups, anchors=anchors if anchored else None
    )


def shorter_is_better(tokens: np.ndarray) -> np.ndarray:
    return -tokens / 4  # 4 tokens shorter: one unit of the judge's noise


def longer_is_better(tokens: np.ndarray) -> np.ndarray:
    return tokens / 4


def pure_length(tokens: np.ndarray) -> np.ndarray:
    return tokens / 40  # length decides, with as much noise as a 40-token difference


def test_the_baseline_cut_to_three_quarters_judged_by_a_shorter_is_better_judge_is_not_identifiable() -> None:
    """Cut by a quarter, nearly every pair is decided by length: the verdicts cannot show a gain beyond it."""
    lengths = baseline_lengths(seed=1)
    cut = np.floor(lengths * 0.75)  # every pair one-sided: the challenger is the baseline, shorter
    without_anchors = controlled(cut, lengths, shorter_is_better, anchored=False)
    assert not without_anchors.identifiable and without_anchors.unidentified_reason().startswith("not identifiable")
    result = controlled(cut, lengths, shorter_is_better)
    assert result.anchors_reaching >= 30 and result.length_effect < -1  # the anchors measured the taste for short
    assert not result.identifiable and (result.one_sided or result.informative_pairs < 60)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_baseline_cut_by_a_tenth_judged_by_a_shorter_is_better_judge_is_not_above_even(seed: int) -> None:
    lengths = baseline_lengths(seed)
    cut = np.floor(lengths * 0.9)
    assert not controlled(cut, lengths, shorter_is_better, anchored=False).identifiable
    result = controlled(cut, lengths, shorter_is_better)
    assert result.identifiable and result.length_effect < -1
    assert result.low <= 0.5 <= result.high  # no gain beyond length, where the raw rate is above 0.9


def test_the_baseline_padded_judged_by_a_longer_is_better_judge_is_not_above_even() -> None:
    lengths = baseline_lengths(seed=2)
    result = controlled(np.ceil(lengths * 1.3), lengths, longer_is_better)
    assert result.length_effect > 1  # the anchors measured the judge's taste for long replies
    assert not result.identifiable and result.unidentified_reason().startswith(
        "not identifiable: the judge's length preference decides nearly every compared pair"
    )


@pytest.mark.parametrize("factor", [0.8, 1.25])
def test_a_gain_independent_of_length_passes_whether_the_challenger_is_shorter_or_longer(factor: float) -> None:
    """A judge that rewards a property the challenger has (+1 unit of its noise on every pair) and pays
    nothing for length: shorter or longer on every pair, the gain is found."""
    lengths = baseline_lengths(seed=3)
    result = controlled(np.round(lengths * factor), lengths, lambda tokens: 0 * tokens, quality=1.0)
    assert result.identifiable and result.low > 0.5
    assert result.rate == pytest.approx(0.76, abs=0.06)  # P(1 + noise_a > noise_b), noise N(0, 2): 0.76


@pytest.mark.parametrize("sides", ["one-sided", "two-sided"])
def test_a_pure_length_judge_with_anchors_gives_even_for_one_and_two_sided_length_differences(sides: str) -> None:
    lengths = baseline_lengths(seed=4)
    if sides == "one-sided":
        tokens_a = np.round(lengths * 1.3)
    else:
        tokens_a = np.maximum(5, lengths + np.random.default_rng(5).normal(15, 30, lengths.shape)).round()
        assert 0.05 < (tokens_a < lengths).mean() < 0.5
    result = controlled(tokens_a, lengths, pure_length)
    assert result.identifiable and result.low <= 0.5 <= result.high
    assert result.rate == pytest.approx(0.5, abs=0.08)


def test_anchors_must_reach_the_compared_length_differences() -> None:
    """Anchor pairs of nearly equal length measure the judge's length term only near dlen 0: with the
    compared pairs 25% apart, too few reach that far and the rate is not identifiable."""
    lengths = np.full((PROMPTS, SAMPLES), 80.0) + np.random.default_rng(6).integers(0, 3, (PROMPTS, SAMPLES))
    result = controlled(np.floor(lengths * 0.75), lengths, pure_length)
    assert not result.one_sided and result.anchor_pairs == PROMPTS * (SAMPLES - 1) and result.anchors_reaching == 0
    assert not result.identifiable
    assert result.unidentified_reason() == (
        f"not identifiable: 0 of {PROMPTS * (SAMPLES - 1)} anchor pairs reach the compared pairs' median |dlen| "
        f"of {result.length_reach:.0f} tokens, 30 needed"
    )


def test_the_fit_with_anchor_rows_matches_scipy() -> None:
    """The anchor rows' logit is the length terms alone, sum over ANCHORED_WIDTHS w of phi_w * tanh(dlen /
    (w sd)); each anchor verdict enters in both orientations at weight 1/2; sd is over every row, weighted."""
    optimize = pytest.importorskip("scipy.optimize")
    rng = np.random.default_rng(9)
    differences = rng.normal(-20, 10, 60).round()
    preferences = rng.choice([0.0, 0.5, 1.0], size=60, p=[0.2, 0.1, 0.7])
    anchor_differences = rng.normal(0, 25, 40).round()
    anchor_preferences = (anchor_differences + rng.normal(0, 20, 40) < 0).astype(float)
    rows = np.concatenate([differences, anchor_differences, -anchor_differences])
    weights = np.concatenate([np.ones(60), np.full(80, 0.5)])
    targets = np.concatenate([preferences, anchor_preferences, 1 - anchor_preferences])
    mean = (weights * rows).sum() / weights.sum()
    scale = np.sqrt((weights * (rows - mean) ** 2).sum() / (weights.sum() - 1))
    model = np.concatenate([np.ones(60), np.zeros(80)])

    def objective(params: np.ndarray) -> float:
        length = sum(phi * np.tanh(rows / (width * scale)) for phi, width in zip(params[1:], (1.0, 4.0, 0.25)))
        logits = params[0] * model + length
        loss = weights * (np.logaddexp(0, logits) - targets * logits)
        return float(loss.sum() + REGULARISATION / 2 * params @ params)

    reference = optimize.minimize(objective, np.zeros(4), method="BFGS", options={"gtol": 1e-9}).x
    anchors = AnchorRows(
        anchor_preferences, anchor_differences, list(range(60, 100)), min_reaching=1, min_informative=1
    )
    result = length_controlled_win_rate(preferences, differences, resamples=10, groups=range(60), anchors=anchors)
    assert (result.theta, result.phi, *result.other_length_terms) == pytest.approx(tuple(reference), abs=1e-5)
    assert result.length_scale == pytest.approx(scale)
    assert result.length_reach == np.median(np.abs(differences))
    assert result.anchors_reaching == int((np.abs(anchor_differences) >= result.length_reach).sum())
    assert (result.pairs, result.prompts, result.anchor_pairs) == (60, 60, 40)
