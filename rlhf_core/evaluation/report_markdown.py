"""report.md: the figures of an `EvaluationReport` for people.

It leads with what reply length cannot fake (report.py says why): the length-controlled win
rate, the length-matched pairs (with a warning when there are fewer than `MIN_LENGTH_MATCHED_PAIRS`),
the length ratio and mean lengths; then the plain win/tie/lose table, the judge's score difference,
the alignment tax, agreement with other judges and the judge's own figures.
"""

from __future__ import annotations

from rlhf_core.evaluation.report import (
    MIN_LENGTH_MATCHED_PAIRS,
    EvaluationReport,
    LengthMatchedSummary,
    OutcomeSummary,
    Rate,
    ScoreDifference,
)


def _rate_cell(rate: Rate | None, signed: bool = False) -> str:
    if rate is None:
        return "n/a"
    sign = "+" if signed else ""
    return f"{rate.rate:{sign}.1%} ({rate.low:{sign}.1%} to {rate.high:{sign}.1%})"


def _outcome_row(label: str, summary: OutcomeSummary) -> str:
    return (
        f"| {label} | {summary.valid} | {_rate_cell(summary.win)} | {_rate_cell(summary.tie)} | "
        f"{_rate_cell(summary.lose)} | {_rate_cell(summary.win_minus_loss, signed=True)} | {summary.invalid} |"
    )


def _score_diff_lines(difference: ScoreDifference | None) -> list[str]:
    if difference is None:
        return []
    return [
        "",
        (
            f"Judge score of A's reply minus B's, per pair: mean {difference.mean:+.4g} (95% paired bootstrap "
            f"interval {difference.low:+.4g} to {difference.high:+.4g}) over {difference.pairs} pairs."
        ),
    ]


def _length_controlled_line(report: EvaluationReport) -> str:
    result = report.length_controlled
    if result is None:
        return "- **Length-controlled win rate of A:** n/a (no valid verdict)."
    unidentified = result.unidentified_reason()
    if unidentified is not None:
        return (
            f"- **Length-controlled win rate of A: {unidentified}.** The verdicts cannot tell the judge's "
            "preference for A from its preference for length: no rate is given (docs/evaluation.md)."
        )
    pays = "longer" if result.length_effect > 0 else "shorter"
    return (
        f"- **Length-controlled win rate of A: {result.rate:.1%} (95% bootstrap interval {result.low:.1%} to "
        f"{result.high:.1%})** over {result.pairs} pairs of {result.prompts} prompts (the interval resamples "
        f"the prompts) and {result.anchor_pairs} anchor pairs (B against itself, {result.anchors_reaching} "
        f"as far apart as the compared pairs' median {result.length_reach:.0f} tokens): the judge's preference "
        f"for A predicted at equal reply length (AlpacaEval 2.0's model with its anchor rows; 50%: no "
        f"preference beyond length). The judge's length terms give the reply {result.length_scale:.1f} tokens "
        f"longer {result.length_effect:+.2f} logits: it favours the {pays} reply; "
        f"{result.informative_pairs:.0f} of the {result.pairs} compared pairs are informative (not decided by "
        "length alone)."
    )


def _length_matched_line(matched: LengthMatchedSummary | None) -> str:
    if matched is None:
        return "- **Length-matched pairs:** none were drawn for this judge."
    outcome = matched.outcome
    return (
        f"- **Length-matched pairs: {outcome.valid} valid of {outcome.pairs}**, A wins "
        f"{_rate_cell(outcome.win)}, ties {_rate_cell(outcome.tie)}, B wins {_rate_cell(outcome.lose)}; "
        f"**win - lose {_rate_cell(outcome.win_minus_loss, signed=True)}**. Per prompt, the closest-length "
        f"pair of {matched.samples_per_model} replies per model, chosen by length alone before judging and "
        f"kept when within {matched.ratio:.0%} of the longer (mean {matched.mean_tokens_a:.1f} vs "
        f"{matched.mean_tokens_b:.1f} tokens)."
    )


def _few_matched_pairs_lines(matched: LengthMatchedSummary | None) -> list[str]:
    if matched is None or matched.outcome.valid >= MIN_LENGTH_MATCHED_PAIRS:
        return []
    return [
        "",
        (
            f"> **Few length-matched pairs ({matched.outcome.valid} < {MIN_LENGTH_MATCHED_PAIRS}).** Their "
            "interval is wide; raise `evaluation.length_matched_samples` or `evaluation.max_prompts` for more."
        ),
    ]


def headline_lines(report: EvaluationReport) -> list[str]:
    """The length-controlled section report.md opens with."""
    length = report.length
    ratio = "n/a" if length.length_ratio is None else f"{length.length_ratio:.2f}"
    return [
        "## Length-controlled result",
        "",
        _length_controlled_line(report),
        _length_matched_line(report.length_matched),
        (
            f"- **Length ratio A / B: {ratio}** (mean reply length A {length.mean_tokens_a:.1f} tokens, "
            f"B {length.mean_tokens_b:.1f} tokens)."
        ),
        *_few_matched_pairs_lines(report.length_matched),
    ]


def _plain_lines(report: EvaluationReport) -> list[str]:
    generation = report.generation
    return [
        "## Plain rates",
        "",
        (
            f"{report.prompts} held-out prompts, one main reply per model (top-p {generation.top_p:g}, "
            f"temperature {generation.temperature:g}, repetition penalty {generation.repetition_penalty:g}, at "
            f"most {generation.max_new_tokens} new tokens). Rates are over the pairs with a valid verdict, with "
            "95% Wilson intervals; win minus lose has a 95% paired bootstrap interval."
        ),
        "",
        "| pairs | valid | A wins | tie | B wins | win - lose | invalid |",
        "|---|---|---|---|---|---|---|",
        _outcome_row("all", report.overall),
        *(_outcome_row(name, summary) for name, summary in report.by_category.items()),
        _outcome_row(f"similar length (within {report.length.similar_length_ratio:.0%})", report.length.similar_length),
        *_score_diff_lines(report.score_diff),
    ]


def _agreement_lines(report: EvaluationReport) -> list[str]:
    lines: list[str] = []
    for agreement in report.agreement:
        if agreement.pairs == 0:
            lines += ["", f"Agreement with {agreement.other_judge}: no pair judged validly by both."]
            continue
        kappa = "undefined" if agreement.kappa is None else f"{agreement.kappa:.3f}"
        lines += [
            "",
            (
                f"Agreement with {agreement.other_judge} on {agreement.pairs} pairs: {agreement.percent:.1%}, "
                f"Cohen's kappa {kappa}."
            ),
        ]
    return lines


def render_markdown(report: EvaluationReport) -> str:
    """report.md: the judge, the length-controlled headline, then the plain figures."""
    lines = [
        f"# Evaluation: {report.model_a} (A) vs {report.model_b} (B)",
        "",
        f"**Judge:** {report.judge.role}: {report.judge.description}.",
    ]
    if report.judge.in_sample:
        lines += [
            "",
            (
                "> **In-sample judge.** This reward model is the one PPO optimised against: the policy was "
                "trained to please it, so these verdicts overstate its quality. Judge with an independent "
                "reward model (trained on a disjoint split), an LLM or people before promoting on this evidence."
            ),
        ]
    lines += ["", *headline_lines(report), "", *_plain_lines(report)]
    if report.alignment_tax is not None:
        tax = report.alignment_tax
        lines += [
            "",
            (
                f"Alignment tax: perplexity of {tax.replies} held-out SFT replies {tax.perplexity_a:.3f} (A) vs "
                f"{tax.perplexity_b:.3f} (B), a change of {tax.change:+.3f} ({tax.relative_change:+.1%}; "
                "positive: A predicts them worse)."
            ),
        ]
    lines += _agreement_lines(report)
    if report.judge.figures:
        figures = ", ".join(f"{name} {value:g}" for name, value in report.judge.figures.items())
        lines += ["", f"Judge figures: {figures}."]
    return "\n".join(lines) + "\n"
