"""The length-controlled win rate of AlpacaEval 2.0 (Dubois et al. 2024, arXiv 2404.04475).

Judges prefer longer replies, and PPO learns reply length before anything else, so a raw
win rate mixes "A is better" with "A is longer (or shorter) where the judge likes that". The
length-controlled win rate asks what the judge would prefer if both replies had the same length: a
logistic model of the judge's preference for A,

    P(A preferred) = sigmoid(theta + phi * tanh(dlen / sd(dlen))),    dlen = tokens_A - tokens_B,

is fitted to the verdicts (preference 1 for an A win, 0.5 for a tie, 0 for a B win; invalid verdicts
are left out), and the win rate is the prediction with the length term at zero: sigmoid(theta).
`phi` is what the judge pays for length; `tanh` bounds it, so a few very long replies cannot dominate.
sd is the sample standard deviation (ddof 1) of dlen over the pairs, as alpaca_eval scales it.

Anchor rows (AlpacaEval 2.0's baseline against verbose and concise versions of itself): model B's reply
to a prompt against another of its own, judged by the same judge. Their quality difference is zero, so in
the same fit their logit is the length terms alone (theta is zero for them), and they measure the judge's
length preference wherever the compared pairs sit. Without them, when every compared dlen has one sign
and the verdicts follow it, theta and phi are not separable (a policy that only learned to stop earlier
scored 0.99). Each anchor verdict enters in both orientations with weight 1/2. With anchors the length
curve has three terms, phi_w * tanh(dlen / (w sd)) for the `ANCHORED_WIDTHS` w: alpaca_eval's (w 1),
a nearly linear one and a steep one; `phi` is alpaca_eval's, `length_effect` their sum at dlen = +sd.

Identified (`identifiable`; otherwise callers show "not identifiable", never the number) only with
anchors, at least `min_reaching` of them with |dlen| at least the compared pairs' median |dlen|, not every
compared verdict a win (or a loss: theta then has no finite estimate), and at least `min_informative`
informative compared pairs: the sum of 4 p (1 - p), p the preference the length terms alone predict for
each (a pair length decides counts 0: its verdict cannot show a gain beyond length).

Differences from alpaca_eval (src/alpaca_eval/metrics/glm_winrate.py), for one pair of models: length
in tokens, not characters; no per-instruction difficulty term (not identified with one comparison);
anchors from the baseline's own sampled replies at full weight, not rewritten versions; a fixed weak L2
penalty `REGULARISATION / 2 * |params|^2` on the summed log loss, not its cross-validated L1 penalty.

The interval is a percentile bootstrap over prompts: each resample draws the prompts with replacement,
each with all its pairs (anchor pairs included), and refits the whole model, sd (over all rows,
weighted) included. The evaluation fits `evaluation.length_controlled_samples` pairs per prompt (A's
i-th sampled reply against B's i-th), still counting prompts, not pairs, as the independent draws. All
resamples are fitted at once by a vectorised damped Newton method.

Degenerate inputs give finite figures, never NaN: all ties give exactly 0.5 (0.5 to 0.5); all wins
(losses) give a rate just below 1 (above 0), bounded away from it only by the penalty; when every pair
has the same dlen (sd 0) the length terms are zero and the rate is the plain preference rate. See
docs/evaluation.md.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
from pydantic import BaseModel, model_validator

from rlhf_core.evaluation.judges.verdicts import Verdict

REGULARISATION = 0.01  # L2 penalty on (theta, phi), against the summed log loss (alpaca_eval's 1/C with C = 100)
RESAMPLE_CHUNK = 1000  # resamples fitted together: bounds memory at a few [chunk, pairs] arrays
NEWTON_ITERATIONS = 100
NEWTON_TOLERANCE = 1e-10
MAX_STEP_HALVINGS = 40
# The widths, in sd(dlen), of the length terms tanh(dlen / (width * sd)): alpaca_eval's one alone without
# anchor rows; with them (which measure the length curve on pairs of equal quality) also a wide one,
# nearly linear over the pairs, and a steep one, for a judge that decides on small length differences.
WIDTHS = (1.0,)
ANCHORED_WIDTHS = (1.0, 4.0, 0.25)


class JudgedLengths(Protocol):
    """What the fit needs of a judged pair (report.py's `JudgedPair`): the verdict and both lengths."""

    @property
    def verdict(self) -> Verdict: ...
    @property
    def tokens_a(self) -> int: ...
    @property
    def tokens_b(self) -> int: ...


class LengthControlledWinRate(BaseModel):
    """The length-controlled win rate of A over B with its 95% bootstrap interval, and the fitted model."""

    rate: float  # sigmoid(theta): the predicted preference for A at equal length
    low: float
    high: float
    pairs: int  # valid verdicts fitted
    prompts: int  # the prompts they belong to: what the bootstrap resamples
    theta: float  # the logit of the preference for A at equal length
    phi: float  # the weight of tanh(dlen / sd): positive, the judge prefers the longer reply
    other_length_terms: list[float] = []  # with anchor rows, the weights of the other ANCHORED_WIDTHS' terms
    length_effect: float = 0.0  # the length terms' logit at dlen = +sd: positive, the judge prefers longer
    length_scale: float  # sd(dlen) in tokens (0: every pair had the same length difference)
    # A report.json written before anchor rows has none: not identifiable, as fitted then.
    anchor_pairs: int = 0  # valid anchor verdicts (B against B) in the fit
    anchors_reaching: int = 0  # of them, those with |dlen| >= length_reach
    length_reach: float = 0.0  # the median |dlen| of the compared pairs, in tokens
    min_reaching: int = 0  # the anchors reaching that far the rate needs to be identified
    informative_pairs: float = 0.0  # sum over compared pairs of 4 p (1 - p), p the length terms' prediction
    min_informative: float = 0.0  # the informative pairs the rate needs to be identified
    one_sided: bool = False  # every compared verdict a win (or every one a loss): theta is not bounded
    identifiable: bool = False  # rate, low and high mean something only when True

    @model_validator(mode="before")
    @classmethod
    def _one_pair_per_prompt_before_prompts_were_counted(cls, data: Any) -> Any:
        """A report.json written before pairs were grouped by prompt fitted one pair per prompt."""
        if isinstance(data, dict) and "prompts" not in data and "pairs" in data:
            return {**data, "prompts": data["pairs"]}
        return data

    def unidentified_reason(self) -> str | None:
        """Why the rate is not identified (None: it is), e.g. `not identifiable: 12 of 40 anchor pairs reach
        the compared pairs' median |dlen| of 25 tokens, 30 needed`."""
        if self.identifiable:
            return None
        if self.one_sided:
            return (
                "not identifiable: the challenger won (or lost) every compared pair, so the verdicts bound its "
                "preference beyond length from one side only"
            )
        if self.anchor_pairs == 0:
            return (
                "not identifiable: no anchor pairs (the baseline against itself) "
                "to measure the judge's length preference"
            )
        if self.anchors_reaching < self.min_reaching:
            return (
                f"not identifiable: {self.anchors_reaching} of {self.anchor_pairs} anchor pairs reach the compared "
                f"pairs' median |dlen| of {self.length_reach:.0f} tokens, {self.min_reaching} needed"
            )
        return (
            f"not identifiable: the judge's length preference decides nearly every compared pair (informative "
            f"pairs {self.informative_pairs:.1f} of {self.pairs}, {self.min_informative:g} needed)"
        )


@dataclass(frozen=True)
class AnchorRows:
    """Verdicts of the baseline against its own other replies (`preferences` [M]: 1 the first reply
    preferred, 0.5 tie, 0 the second), their dlen [M] (first minus second), their prompts [M] (the same
    labels as the compared pairs' `groups`), how many must reach the compared pairs' median |dlen| for the
    rate to be identified (`min_reaching`), and how many informative compared pairs it needs
    (`min_informative`: sum of 4 p (1 - p), p the length terms' prediction for the pair)."""

    preferences: Sequence[float] | np.ndarray
    length_differences: Sequence[float] | np.ndarray
    groups: Sequence[Hashable]
    min_reaching: int
    min_informative: float


def length_scales(differences: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Sample standard deviation (ddof 1) of `differences` [N] in each resample, `counts` [B, N] the
    times each pair is drawn; 0 where fewer than two pairs are drawn."""
    total = counts.sum(axis=1)  # [B]
    mean = (counts * differences).sum(axis=1) / total
    squares = (counts * (differences - mean[:, None]) ** 2).sum(axis=1)
    return np.sqrt(np.where(total > 1, squares / np.maximum(total - 1, 1), 0.0))


def length_features(differences: np.ndarray, scales: np.ndarray, widths: Sequence[float] = (1.0,)) -> np.ndarray:
    """tanh(dlen / (width * sd)) [B, N, K] for each resample's sd [B] and each of the K `widths`; all zero
    where sd is 0 (no length signal)."""
    safe = np.where(scales > 0, scales, 1.0)[:, None, None] * np.asarray(widths)
    return np.where(scales[:, None, None] > 0, np.tanh(differences[None, :, None] / safe), 0.0)


def design(features: np.ndarray, model_rows: np.ndarray) -> np.ndarray:
    """[B, N, 1 + K]: each row's model indicator (1 a compared pair, 0 an anchor pair), then its features."""
    indicator = np.broadcast_to(model_rows[None, :, None], (*features.shape[:2], 1))
    return np.concatenate([indicator, features], axis=2)


def penalised_loss(
    params: np.ndarray, rows: np.ndarray, preferences: np.ndarray, counts: np.ndarray, regularisation: float
) -> np.ndarray:
    """The objective [B] of each resample: sum over pairs of count * cross-entropy of the soft preference
    with sigmoid(rows @ params) (theta * model_row + sum_k phi_k * feature_k), plus regularisation / 2 *
    |params|^2; `params` [B, P], `rows` the design [B, N, P]."""
    logits = np.einsum("bnp,bp->bn", rows, params)
    cross_entropy = np.logaddexp(0.0, logits) - preferences * logits  # -y log s - (1 - y) log(1 - s)
    return (counts * cross_entropy).sum(axis=1) + regularisation / 2 * (params**2).sum(axis=1)


def fit_length_model(
    features: np.ndarray,
    preferences: np.ndarray,
    counts: np.ndarray,
    regularisation: float = REGULARISATION,
    model_rows: np.ndarray | None = None,
) -> np.ndarray:
    """(theta, phi_1 .. phi_K) [B, 1 + K] minimising `penalised_loss` for every resample at once;
    `features` [B, N, K] (`length_features`), `model_rows` [N] (None: every row a compared pair).

    Newton's method with step halving: the objective is strictly convex (the penalty), and a step is
    halved until it does not increase the objective, so every resample converges from zero.
    """
    rows = design(features, np.ones(features.shape[1]) if model_rows is None else model_rows)
    params = np.zeros((features.shape[0], rows.shape[2]))
    ridge = regularisation * np.eye(rows.shape[2])
    loss = penalised_loss(params, rows, preferences, counts, regularisation)
    for _ in range(NEWTON_ITERATIONS):
        probabilities = _sigmoid(np.einsum("bnp,bp->bn", rows, params))
        gradient = np.einsum("bn,bnp->bp", counts * (probabilities - preferences), rows) + regularisation * params
        curvature = counts * probabilities * (1.0 - probabilities)
        hessian = np.einsum("bn,bnp,bnq->bpq", curvature, rows, rows) + ridge
        step = np.linalg.solve(hessian, gradient[:, :, None])[:, :, 0]
        scale = np.ones(len(params))
        for _ in range(MAX_STEP_HALVINGS):
            trial = params - scale[:, None] * step
            trial_loss = penalised_loss(trial, rows, preferences, counts, regularisation)
            worse = trial_loss > loss + 1e-12 * np.abs(loss)
            if not worse.any():
                break
            scale = np.where(worse, scale / 2, scale)
        accepted = ~worse  # a step still worse after every halving: already at the optimum, to rounding
        params = np.where(accepted[:, None], trial, params)
        loss = np.where(accepted, trial_loss, loss)
        if np.abs(scale[:, None] * step).max() < NEWTON_TOLERANCE:
            break
    return params


def _sigmoid(values: np.ndarray) -> np.ndarray:
    return np.exp(-np.logaddexp(0.0, -values))


def _check_inputs(preferences: np.ndarray, differences: np.ndarray) -> None:
    if preferences.ndim != 1 or preferences.size == 0 or preferences.shape != differences.shape:
        raise ValueError(
            f"preferences and length differences must be non-empty 1-d and of one length, got shapes "
            f"{preferences.shape} and {differences.shape}"
        )
    if not ((preferences >= 0) & (preferences <= 1)).all():
        raise ValueError("preferences must be in [0, 1] (1: A preferred, 0.5: tie, 0: B preferred)")
    if not np.isfinite(differences).all():
        raise ValueError("length differences must be finite")


def group_indices(groups: Sequence[Hashable] | None, size: int) -> tuple[np.ndarray, int]:
    """Each pair's group as 0..G-1 in order of first appearance [size], and G; None: every pair alone."""
    if groups is None:
        return np.arange(size), size
    if len(groups) != size:
        raise ValueError(f"{len(groups)} groups for {size} preferences")
    first_seen: dict[Hashable, int] = {}
    indices = np.array([first_seen.setdefault(group, len(first_seen)) for group in groups])
    return indices, len(first_seen)


def resample_counts(rng: np.random.Generator, group_of_pair: np.ndarray, groups: int, chunk: int) -> np.ndarray:
    """[chunk, pairs]: how often each pair is drawn in each of `chunk` resamples that draw `groups` groups
    with replacement, every pair of a drawn group with it."""
    drawn = rng.integers(0, groups, size=(chunk, groups))
    counts = np.bincount((drawn + groups * np.arange(chunk)[:, None]).ravel(), minlength=chunk * groups)
    return counts.reshape(chunk, groups)[:, group_of_pair].astype(np.float64)


@dataclass(frozen=True)
class FitRows:
    """The rows of the fit: preferences [N], dlen [N], weights [N] and each row's prompt [N]."""

    preferences: np.ndarray
    differences: np.ndarray
    weights: np.ndarray
    groups: list[Hashable]

    def joined(self, other: FitRows) -> FitRows:
        """These rows, then `other`'s."""
        return FitRows(
            np.concatenate([self.preferences, other.preferences]),
            np.concatenate([self.differences, other.differences]),
            np.concatenate([self.weights, other.weights]),
            self.groups + other.groups,
        )


def symmetric_anchor_rows(anchors: AnchorRows) -> FitRows:
    """Each anchor verdict in both orientations (the first M rows as given, then the M turned round),
    each with weight 1/2."""
    targets = np.asarray(anchors.preferences, dtype=np.float64)
    differences = np.asarray(anchors.length_differences, dtype=np.float64)
    _check_inputs(targets, differences)
    if len(anchors.groups) != targets.size:
        raise ValueError(f"{len(anchors.groups)} groups for {targets.size} anchor preferences")
    return FitRows(
        np.concatenate([targets, 1 - targets]),
        np.concatenate([differences, -differences]),
        np.full(2 * targets.size, 0.5),
        list(anchors.groups) * 2,
    )


def length_controlled_win_rate(
    preferences: Sequence[float] | np.ndarray,
    length_differences: Sequence[float] | np.ndarray,
    confidence: float = 0.95,
    resamples: int = 2000,
    seed: int = 0,
    regularisation: float = REGULARISATION,
    groups: Sequence[Hashable] | None = None,
    anchors: AnchorRows | None = None,
) -> LengthControlledWinRate:
    """The length-controlled win rate of valid verdicts (see the module docstring).

    `preferences` [N]: 1 (A won), 0.5 (tie), 0 (B won); `length_differences` [N]: tokens_A - tokens_B of
    the same pairs; `groups` [N]: the prompt of each pair (None: one pair per prompt); `anchors`: the
    baseline's pairs against itself (None: none, so not identifiable). With G prompts (numbered in order
    of first appearance, the compared pairs' first), resample r draws row r of `rng.integers(0, G,
    size=(chunk, G))` over chunks of `RESAMPLE_CHUNK` resamples, rng numpy's default generator seeded with
    `seed`; the interval is the (1 - confidence) / 2 and (1 + confidence) / 2 quantiles of sigmoid(theta).
    """
    targets = np.asarray(preferences, dtype=np.float64)
    differences = np.asarray(length_differences, dtype=np.float64)
    _check_inputs(targets, differences)
    _check_settings(resamples, confidence, groups, targets.size)
    compared = targets.size
    reach = float(np.median(np.abs(differences)))
    one_sided = bool((targets == 1).all() or (targets == 0).all())
    rows = FitRows(targets, differences, np.ones(compared), list(range(compared)) if groups is None else list(groups))
    anchor_count = reaching = 0
    if anchors is not None:
        rows, anchor_count, reaching = with_anchor_rows(rows, anchors, reach)
    model_rows = (np.arange(rows.preferences.size) < compared).astype(np.float64)
    widths = WIDTHS if anchors is None else ANCHORED_WIDTHS
    fitted, scale, informative = point_fit(rows, model_rows, widths, regularisation)
    theta, phi, *others = fitted
    rates = bootstrap_rates(rows, model_rows, widths, resamples, seed, regularisation)
    tail = (1 - confidence) / 2
    low, high = np.quantile(rates, [tail, 1 - tail])
    min_reaching, min_informative = (0, 0.0) if anchors is None else (anchors.min_reaching, anchors.min_informative)
    return LengthControlledWinRate(
        rate=float(_sigmoid(np.array(theta))),
        low=float(low),
        high=float(high),
        pairs=compared,
        prompts=len(set(rows.groups[:compared])),
        theta=float(theta),
        phi=float(phi),
        other_length_terms=[float(value) for value in others],
        length_effect=float(np.tanh(1 / np.asarray(widths)) @ fitted[1:]),
        length_scale=scale,
        anchor_pairs=anchor_count,
        anchors_reaching=reaching,
        length_reach=reach,
        min_reaching=min_reaching,
        informative_pairs=informative,
        min_informative=min_informative,
        one_sided=one_sided,
        identifiable=(
            not one_sided and anchor_count > 0 and reaching >= min_reaching and informative >= min_informative
        ),
    )


def _check_settings(resamples: int, confidence: float, groups: Sequence[Hashable] | None, size: int) -> None:
    if resamples < 1:
        raise ValueError(f"resamples must be >= 1, got {resamples}")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    if groups is not None and len(groups) != size:
        raise ValueError(f"{len(groups)} groups for {size} preferences")


def with_anchor_rows(rows: FitRows, anchors: AnchorRows, reach: float) -> tuple[FitRows, int, int]:
    """The compared `rows` with the anchors' symmetric rows after them, the anchor verdicts and how many
    of them have |dlen| >= `reach`."""
    anchor_rows = symmetric_anchor_rows(anchors)
    count = anchor_rows.preferences.size // 2
    return rows.joined(anchor_rows), count, int((np.abs(anchor_rows.differences[:count]) >= reach).sum())


def point_fit(
    rows: FitRows, model_rows: np.ndarray, widths: Sequence[float], regularisation: float
) -> tuple[np.ndarray, float, float]:
    """The fit on all rows: (theta, phi_1 .. phi_K), sd(dlen), and the informative compared pairs (sum of
    4 p (1 - p), p the length terms' prediction for each compared pair, at theta 0)."""
    whole = rows.weights[None, :]
    scale = length_scales(rows.differences, whole)
    features = length_features(rows.differences, scale, widths)
    fitted = fit_length_model(features, rows.preferences, whole, regularisation, model_rows)[0]
    length_only = _sigmoid(features[0, model_rows == 1] @ fitted[1:])
    return fitted, float(scale[0]), float((4 * length_only * (1 - length_only)).sum())


def bootstrap_rates(
    rows: FitRows, model_rows: np.ndarray, widths: Sequence[float], resamples: int, seed: int, regularisation: float
) -> np.ndarray:
    """sigmoid(theta) [resamples] of the fit refitted on each resample of the prompts (see
    `length_controlled_win_rate` for the draws)."""
    group_of_pair, prompts = group_indices(rows.groups, rows.preferences.size)
    rng = np.random.default_rng(seed)
    rates = []
    for start in range(0, resamples, RESAMPLE_CHUNK):
        chunk = min(RESAMPLE_CHUNK, resamples - start)
        counts = resample_counts(rng, group_of_pair, prompts, chunk) * rows.weights
        features = length_features(rows.differences, length_scales(rows.differences, counts), widths)
        rates.append(_sigmoid(fit_length_model(features, rows.preferences, counts, regularisation, model_rows)[:, 0]))
    return np.concatenate(rates)


def valid_by_prompt(pairs_by_prompt: Sequence[Sequence[JudgedLengths]]) -> list[tuple[int, JudgedLengths]]:
    """(prompt index, pair) of every pair with a valid verdict."""
    return [
        (prompt, pair)
        for prompt, pairs in enumerate(pairs_by_prompt)
        for pair in pairs
        if pair.verdict is not Verdict.INVALID
    ]


def summarise_length_control(
    pairs_by_prompt: Sequence[Sequence[JudgedLengths]],
    confidence: float,
    seed: int,
    resamples: int,
    anchors_by_prompt: Sequence[Sequence[JudgedLengths]] | None,
    min_anchor_pairs: int,
    min_informative_pairs: float,
) -> LengthControlledWinRate | None:
    """The length-controlled win rate over the pairs with a valid verdict (A win 1, tie 0.5, B win 0),
    bootstrapped over the prompts (`pairs_by_prompt[p]`: prompt p's judged pairs); None when there is none.
    `anchors_by_prompt[p]`: prompt p's judged anchor pairs (B's replies against each other; None: none, so
    not identifiable), identified with at least `min_anchor_pairs` reaching the compared pairs' lengths and
    `min_informative_pairs` compared pairs not decided by length alone (length_control.py)."""
    valid = valid_by_prompt(pairs_by_prompt)
    if not valid:
        return None
    anchors = None
    if anchors_by_prompt is not None:
        if len(anchors_by_prompt) != len(pairs_by_prompt):
            raise ValueError(f"anchor pairs of {len(anchors_by_prompt)} prompts for {len(pairs_by_prompt)}")
        anchor_valid = valid_by_prompt(anchors_by_prompt)
        anchors = AnchorRows(
            [(pair.verdict.outcome + 1) / 2 for _, pair in anchor_valid],
            [pair.tokens_a - pair.tokens_b for _, pair in anchor_valid],
            [prompt for prompt, _ in anchor_valid],
            min_anchor_pairs,
            min_informative_pairs,
        )
    return length_controlled_win_rate(
        [(pair.verdict.outcome + 1) / 2 for _, pair in valid],
        [pair.tokens_a - pair.tokens_b for _, pair in valid],
        confidence,
        resamples,
        seed,
        groups=[prompt for prompt, _ in valid],
        anchors=anchors,
    )
