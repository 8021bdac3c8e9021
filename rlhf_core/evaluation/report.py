"""The evaluation report (paper section 6): win/tie/lose of model A against model B, with uncertainty and
the usual confounders in view.

Length first: PPO learns reply length before anything else and judges reward it, so the
headline is what length cannot fake:
- the length-controlled win rate (AlpacaEval 2.0; length_control.py) with its bootstrap interval,
- the outcome over length-matched pairs, drawn judge-blind from several replies per prompt and model
  (length_matching.py), with a warning under `MIN_LENGTH_MATCHED_PAIRS`,
- the length ratio A / B of the main replies, and, for a scoring judge, the Spearman correlation of
  its scores with the length of model B's replies (how much the judge itself pays for length).
Then the plain figures:
- Rates: win, tie and lose rates over the pairs with a valid verdict, each with a 95% Wilson interval;
  invalid verdicts are counted and shown, never folded into a rate.
- Win minus loss (the promotion gate's figure) with a paired bootstrap interval (statistics.py).
- With a judge that scores replies (the reward model): the mean over pairs of A's score minus B's, with
  a paired bootstrap interval. Win/tie/lose counts a narrow and a wide win alike; the score difference
  says by how much A is preferred, in the judge's own units.
- Per category (the source file of the prompts, e.g. harmless vs helpful), when there is more than one.
- Length, the best-known judge bias: the mean reply length of each model in tokens, and the rates over
  the pairs whose lengths are similar (|len_A - len_B| <= SIMILAR_LENGTH_RATIO * max(len_A, len_B)).
  A model that wins overall but not among similar-length pairs may be winning by verbosity.
- Agreement with other judges' verdicts on the same pairs (matched by pair key): percent agreement
  and Cohen's kappa, over the pairs both judged validly.
- The alignment tax (alignment_tax.py).
- Which judge produced it; an in-sample reward-model judge is flagged.

`EvaluationReport` is saved as report.json and `metrics` gives the flat figures of metrics.json
(report_markdown.py renders report.md). Quantities that are undefined (no valid pair) are None / left out.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pydantic import BaseModel

from rlhf_core.config import RolloutConfig
from rlhf_core.evaluation.alignment_tax import AlignmentTax
from rlhf_core.evaluation.judges.verdicts import JudgeInfo, Verdict
from rlhf_core.evaluation.length_control import LengthControlledWinRate, summarise_length_control

# One bound for "similar length" in the report and in the reward models' length-matched accuracy.
from rlhf_core.reward.length_metrics import LENGTH_MATCH_RATIO as SIMILAR_LENGTH_RATIO
from rlhf_core.statistics import (
    DEFAULT_RESAMPLES,
    bootstrap_mean_interval,
    cohens_kappa,
    paired_bootstrap_interval,
    percent_agreement,
    spearman,
    wilson_interval,
)

CONFIDENCE = 0.95
MIN_LENGTH_MATCHED_PAIRS = 60  # fewer length-matched pairs than this are too few to lean on


@dataclass(frozen=True)
class JudgedPair:
    """What the report needs of one judged pair."""

    pair_key: str
    category: str
    tokens_a: int
    tokens_b: int
    verdict: Verdict
    score_diff: float | None = None  # the judge's score of A's reply minus B's; None: the judge gives no scores
    score_b: float | None = None  # the judge's score of B's reply; None: the judge gives no scores


class Rate(BaseModel):
    """A proportion and its 95% Wilson interval."""

    rate: float
    low: float
    high: float


class OutcomeSummary(BaseModel):
    """Win/tie/lose counts and rates of a group of pairs (rates over the `valid` pairs)."""

    pairs: int
    valid: int
    wins: int
    ties: int
    losses: int
    invalid: int
    win: Rate | None
    tie: Rate | None
    lose: Rate | None
    win_minus_loss: Rate | None


class ScoreDifference(BaseModel):
    """The mean over pairs of the judge's score of A's reply minus B's, and its 95% paired bootstrap interval."""

    pairs: int
    mean: float
    low: float
    high: float


class LengthSummary(BaseModel):
    """Mean reply lengths (tokens) and the outcome over similar-length pairs."""

    mean_tokens_a: float
    mean_tokens_b: float
    similar_length_ratio: float
    similar_length: OutcomeSummary

    @property
    def length_ratio(self) -> float | None:
        """Mean tokens of A's replies over B's (policy / SFT in the pipeline); None when B's are all empty."""
        return self.mean_tokens_a / self.mean_tokens_b if self.mean_tokens_b > 0 else None


class LengthMatchedSummary(BaseModel):
    """The outcome over the length-matched pairs: per prompt, the closest-length pair of
    `samples_per_model` replies of each model, kept when within `ratio` of the longer (length_matching.py)."""

    samples_per_model: int
    ratio: float
    mean_tokens_a: float
    mean_tokens_b: float
    outcome: OutcomeSummary


class Agreement(BaseModel):
    """Agreement of this report's judge with another judge on the pairs both judged validly."""

    other_judge: str
    pairs: int
    percent: float | None
    kappa: float | None


class AlignmentTaxSummary(BaseModel):
    """Held-out SFT reply perplexity of both models and the change (A - B)."""

    replies: int
    perplexity_a: float
    perplexity_b: float
    change: float
    relative_change: float


class JudgeSummary(BaseModel):
    """Who produced the verdicts (see `JudgeInfo`)."""

    kind: str
    name: str
    role: str
    description: str
    in_sample: bool
    figures: dict[str, float]


class EvaluationReport(BaseModel):
    """Everything report.json holds."""

    model_a: str
    model_b: str
    judge: JudgeSummary
    prompts: int
    generation: RolloutConfig
    overall: OutcomeSummary
    by_category: dict[str, OutcomeSummary]
    length: LengthSummary
    agreement: list[Agreement]
    alignment_tax: AlignmentTaxSummary | None
    score_diff: ScoreDifference | None = None  # None: the judge gives no scores (LLM, people)
    length_controlled: LengthControlledWinRate | None = None  # None: no valid verdict
    length_matched: LengthMatchedSummary | None = None  # None: no length-matched pairs were judged

    def metrics(self) -> dict[str, float]:
        """The flat figures of metrics.json (undefined ones left out), the length-controlled ones first."""
        figures: dict[str, float] = {}
        controlled = self.length_controlled
        if controlled is not None:
            if controlled.identifiable:  # else no number: the fit cannot tell quality from length
                figures["lc_win_rate"] = controlled.rate
                figures["lc_win_rate_low"] = controlled.low
                figures["lc_win_rate_high"] = controlled.high
                figures["lc_length_coefficient"] = controlled.phi
            figures["lc_identifiable"] = float(controlled.identifiable)
            figures["lc_pairs"] = float(controlled.pairs)
            figures["lc_prompts"] = float(controlled.prompts)
            figures["lc_anchor_pairs"] = float(controlled.anchor_pairs)
            figures["lc_anchors_reaching"] = float(controlled.anchors_reaching)
            figures["lc_informative_pairs"] = controlled.informative_pairs
        if self.length.length_ratio is not None:
            figures["length_ratio"] = self.length.length_ratio
        if self.length_matched is not None:
            figures.update(_outcome_figures("length_matched/", self.length_matched.outcome))
            figures["length_matched/samples_per_model"] = float(self.length_matched.samples_per_model)
            figures["length_matched/mean_tokens_a"] = self.length_matched.mean_tokens_a
            figures["length_matched/mean_tokens_b"] = self.length_matched.mean_tokens_b
        figures.update({"prompts": float(self.prompts), "judge_in_sample": float(self.judge.in_sample)})
        figures.update(_outcome_figures("", self.overall))
        if self.score_diff is not None:
            figures.update(
                {
                    "score_diff_mean": self.score_diff.mean,
                    "score_diff_low": self.score_diff.low,
                    "score_diff_high": self.score_diff.high,
                    "score_diff_pairs": float(self.score_diff.pairs),
                }
            )
        for name, summary in self.by_category.items():
            figures.update(_outcome_figures(f"category/{name}/", summary))
        figures["mean_tokens_a"] = self.length.mean_tokens_a
        figures["mean_tokens_b"] = self.length.mean_tokens_b
        figures.update(_outcome_figures("similar_length/", self.length.similar_length))
        for agreement in self.agreement:
            prefix = f"agreement/{agreement.other_judge}/"
            figures[prefix + "pairs"] = float(agreement.pairs)
            if agreement.percent is not None:
                figures[prefix + "percent"] = agreement.percent
            if agreement.kappa is not None:
                figures[prefix + "kappa"] = agreement.kappa
        if self.alignment_tax is not None:
            figures["perplexity_a"] = self.alignment_tax.perplexity_a
            figures["perplexity_b"] = self.alignment_tax.perplexity_b
            figures["alignment_tax"] = self.alignment_tax.change
            figures["alignment_tax_relative"] = self.alignment_tax.relative_change
        figures.update({f"judge/{name}": value for name, value in self.judge.figures.items()})
        return figures


def _outcome_figures(prefix: str, summary: OutcomeSummary) -> dict[str, float]:
    figures = {
        f"{prefix}pairs": float(summary.pairs),
        f"{prefix}valid_pairs": float(summary.valid),
        f"{prefix}invalid_pairs": float(summary.invalid),
    }
    for name, rate in (
        ("win_rate", summary.win),
        ("tie_rate", summary.tie),
        ("lose_rate", summary.lose),
        ("win_minus_loss", summary.win_minus_loss),
    ):
        if rate is not None:
            figures.update(
                {f"{prefix}{name}": rate.rate, f"{prefix}{name}_low": rate.low, f"{prefix}{name}_high": rate.high}
            )
    return figures


def _wilson_rate(count: int, total: int) -> Rate:
    low, high = wilson_interval(count, total, CONFIDENCE)
    return Rate(rate=count / total, low=low, high=high)


def summarise_outcomes(verdicts: Sequence[Verdict], seed: int, resamples: int = DEFAULT_RESAMPLES) -> OutcomeSummary:
    """Counts, Wilson-interval rates and the bootstrap interval of win minus loss of `verdicts`."""
    valid = [verdict for verdict in verdicts if verdict is not Verdict.INVALID]
    wins, ties, losses = (sum(verdict is kind for verdict in valid) for kind in (Verdict.A, Verdict.TIE, Verdict.B))
    summary = OutcomeSummary(
        pairs=len(verdicts),
        valid=len(valid),
        wins=wins,
        ties=ties,
        losses=losses,
        invalid=len(verdicts) - len(valid),
        win=None,
        tie=None,
        lose=None,
        win_minus_loss=None,
    )
    if not valid:
        return summary
    low, high = paired_bootstrap_interval([verdict.outcome for verdict in valid], CONFIDENCE, resamples, seed)
    return summary.model_copy(
        update={
            "win": _wilson_rate(wins, len(valid)),
            "tie": _wilson_rate(ties, len(valid)),
            "lose": _wilson_rate(losses, len(valid)),
            "win_minus_loss": Rate(rate=(wins - losses) / len(valid), low=low, high=high),
        }
    )


def summarise_score_differences(
    pairs: Sequence[JudgedPair], seed: int, resamples: int = DEFAULT_RESAMPLES
) -> ScoreDifference | None:
    """Mean and bootstrap interval of the per-pair score differences; None when no pair has scores."""
    differences = [pair.score_diff for pair in pairs if pair.score_diff is not None]
    if not differences:
        return None
    low, high = bootstrap_mean_interval(differences, CONFIDENCE, resamples, seed)
    return ScoreDifference(pairs=len(differences), mean=sum(differences) / len(differences), low=low, high=high)


def summarise_length_matched(
    pairs: Sequence[JudgedPair], samples_per_model: int, seed: int, resamples: int = DEFAULT_RESAMPLES
) -> LengthMatchedSummary:
    """The outcome and mean lengths of the judged length-matched pairs (possibly none)."""
    count = max(len(pairs), 1)
    return LengthMatchedSummary(
        samples_per_model=samples_per_model,
        ratio=SIMILAR_LENGTH_RATIO,
        mean_tokens_a=sum(pair.tokens_a for pair in pairs) / count,
        mean_tokens_b=sum(pair.tokens_b for pair in pairs) / count,
        outcome=summarise_outcomes([pair.verdict for pair in pairs], seed, resamples),
    )


def judge_figures(judge: JudgeInfo, pairs: Sequence[JudgedPair]) -> dict[str, float]:
    """The judge's own figures, plus for a scoring judge `reward_length_spearman_b`: the Spearman
    correlation of its scores of model B's replies with their length in tokens (left out where undefined)."""
    scored = [pair for pair in pairs if pair.score_b is not None]
    correlation = spearman([pair.score_b for pair in scored], [pair.tokens_b for pair in scored])
    extra = {} if correlation is None else {"reward_length_spearman_b": correlation}
    return {**judge.figures, **extra}


def summarise_alignment_tax(tax: AlignmentTax) -> AlignmentTaxSummary:
    """The report's copy of the alignment tax, its derived figures included (pydantic reads them as
    attributes)."""
    return AlignmentTaxSummary.model_validate(tax, from_attributes=True)


def is_similar_length(tokens_a: int, tokens_b: int, ratio: float = SIMILAR_LENGTH_RATIO) -> bool:
    """|tokens_a - tokens_b| <= ratio * max(tokens_a, tokens_b) (two empty replies are similar)."""
    return abs(tokens_a - tokens_b) <= ratio * max(tokens_a, tokens_b)


def judge_agreement(
    verdicts: Mapping[str, Verdict], other_verdicts: Mapping[str, Verdict], other_judge: str
) -> Agreement:
    """Percent agreement and Cohen's kappa over the pair keys both judges judged validly."""
    shared = [
        key for key in verdicts if key in other_verdicts and Verdict.INVALID not in (verdicts[key], other_verdicts[key])
    ]
    if not shared:
        return Agreement(other_judge=other_judge, pairs=0, percent=None, kappa=None)
    mine = [verdicts[key].value for key in shared]
    theirs = [other_verdicts[key].value for key in shared]
    kappa = cohens_kappa(mine, theirs)
    return Agreement(
        other_judge=other_judge,
        pairs=len(shared),
        percent=percent_agreement(mine, theirs),
        kappa=None if math.isnan(kappa) else kappa,
    )


def category_outcomes(pairs: Sequence[JudgedPair], seed: int, resamples: int) -> dict[str, OutcomeSummary]:
    """The outcomes of each prompt category, when the prompts have more than one (else none)."""
    categories = sorted({pair.category for pair in pairs})
    if len(categories) <= 1:
        return {}
    return {
        category: summarise_outcomes([p.verdict for p in pairs if p.category == category], seed, resamples)
        for category in categories
    }


def length_summary(pairs: Sequence[JudgedPair], seed: int, resamples: int) -> LengthSummary:
    """The replies' mean lengths, and the outcomes on the pairs of similar length."""
    similar = [pair.verdict for pair in pairs if is_similar_length(pair.tokens_a, pair.tokens_b)]
    return LengthSummary(
        mean_tokens_a=sum(pair.tokens_a for pair in pairs) / len(pairs),
        mean_tokens_b=sum(pair.tokens_b for pair in pairs) / len(pairs),
        similar_length_ratio=SIMILAR_LENGTH_RATIO,
        similar_length=summarise_outcomes(similar, seed, resamples),
    )


def judge_summary(judge: JudgeInfo, pairs: Sequence[JudgedPair]) -> JudgeSummary:
    """Who judged, as the report names it, with the judge's own figures on these pairs."""
    return JudgeSummary(
        kind=judge.kind,
        name=judge.name,
        role=judge.role,
        description=judge.description,
        in_sample=judge.in_sample,
        figures=judge_figures(judge, pairs),
    )


def build_report(
    pairs: Sequence[JudgedPair],
    judge: JudgeInfo,
    model_a: str,
    model_b: str,
    generation: RolloutConfig,
    seed: int,
    alignment_tax: AlignmentTax | None = None,
    other_judges: Mapping[str, Mapping[str, Verdict]] | None = None,
    resamples: int = DEFAULT_RESAMPLES,
    length_matched: Sequence[JudgedPair] | None = None,
    samples_per_model: int = 1,
    length_control_pairs: Sequence[Sequence[JudgedPair]] | None = None,
    anchor_pairs: Sequence[Sequence[JudgedPair]] | None = None,
    min_anchor_pairs: int = 0,
    min_informative_pairs: float = 0.0,
) -> EvaluationReport:
    """The report of judged `pairs` (one per prompt, the main replies); `other_judges` maps a judge's name
    to its verdicts by pair key; `length_matched`: the judged length-matched pairs, drawn from
    `samples_per_model` replies per prompt and model (None: none were drawn); `length_control_pairs`:
    per prompt, the judged pairs the length-controlled win rate is fitted on (None: its main pair alone);
    `anchor_pairs`: per prompt (the same order), the judged pairs of B's replies against each other, the
    fit's anchor rows (None: none, and the length-controlled win rate is not identifiable);
    `min_anchor_pairs`, `min_informative_pairs`: `evaluation.min_anchor_pairs`, `min_informative_pairs`."""
    if not pairs:
        raise ValueError("build_report: no judged pairs")
    verdicts = [pair.verdict for pair in pairs]
    by_key = {pair.pair_key: pair.verdict for pair in pairs}
    return EvaluationReport(
        model_a=model_a,
        model_b=model_b,
        judge=judge_summary(judge, pairs),
        prompts=len(pairs),
        generation=generation,
        overall=summarise_outcomes(verdicts, seed, resamples),
        by_category=category_outcomes(pairs, seed, resamples),
        length=length_summary(pairs, seed, resamples),
        agreement=[judge_agreement(by_key, other, name) for name, other in sorted((other_judges or {}).items())],
        alignment_tax=None if alignment_tax is None else summarise_alignment_tax(alignment_tax),
        score_diff=summarise_score_differences(pairs, seed, resamples),
        length_controlled=summarise_length_control(
            [[pair] for pair in pairs] if length_control_pairs is None else length_control_pairs,
            CONFIDENCE,
            seed,
            resamples,
            anchor_pairs,
            min_anchor_pairs,
            min_informative_pairs,
        ),
        length_matched=(
            None
            if length_matched is None
            else summarise_length_matched(length_matched, samples_per_model, seed, resamples)
        ),
    )
