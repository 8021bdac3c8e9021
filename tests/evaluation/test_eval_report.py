"""The evaluation report (rates, categories, length, agreement, alignment tax, chart), generation of the
replies, held-out reply perplexity, the evaluation prompts and model-directory resolution."""

from __future__ import annotations

import gzip
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.nn import functional as F

from fixtures.statistics_by_loop import bootstrap_by_loop
from rlhf_core.config import DataConfig, RolloutConfig
from rlhf_core.data.prepare import prepare_preference_data
from rlhf_core.data.validation import TokenLengths
from rlhf_core.evaluation.alignment_tax import AlignmentTax, reply_perplexity
from rlhf_core.evaluation.generation import generate_replies
from rlhf_core.evaluation.judges.verdicts import JudgeInfo, Judgement, Verdict
from rlhf_core.evaluation.length_control import AnchorRows, LengthControlledWinRate, length_controlled_win_rate
from rlhf_core.evaluation.model_dirs import resolve_model_dir
from rlhf_core.evaluation.plots import plot_win_tie_lose
from rlhf_core.evaluation.prompts import category_of, evaluation_prompts
from rlhf_core.evaluation.report import (
    EvaluationReport,
    JudgedPair,
    build_report,
    is_similar_length,
    summarise_outcomes,
)
from rlhf_core.evaluation.report_markdown import render_markdown
from rlhf_core.models.chat import encode_conversation
from rlhf_core.models.tiny import build_tiny_model, load_tiny_model
from rlhf_core.statistics import cohens_kappa, spearman, wilson_interval

A, B, TIE, INVALID = Verdict.A, Verdict.B, Verdict.TIE, Verdict.INVALID
GENERATION = RolloutConfig(max_new_tokens=6, temperature=0.8, top_p=0.9, repetition_penalty=1.1)
RM_JUDGE = JudgeInfo(
    kind="rm",
    name="reward model rm-dir",
    role="the in-sample reward model",
    description="reward model rm-dir (IN-SAMPLE)",
    in_sample=True,
)


def ppo_against_sft(pairs: Sequence[JudgedPair], **options: Any) -> EvaluationReport:
    """`build_report` of `pairs` as a PPO policy (A) against its SFT model (B), judged by `RM_JUDGE`."""
    return build_report(pairs, RM_JUDGE, "ppo", "sft", GENERATION, **options)


@pytest.fixture(scope="module")
def tiny():
    tokenizer = load_tiny_model()[1]
    return build_tiny_model(tokenizer, seed=0), tokenizer


# ---- outcome summaries


def test_summary_counts_rates_and_intervals() -> None:
    verdicts = [A] * 6 + [TIE] * 3 + [B] * 2 + [INVALID] * 2
    summary = summarise_outcomes(verdicts, seed=0, resamples=500)
    assert (summary.pairs, summary.valid, summary.wins, summary.ties, summary.losses, summary.invalid) == (
        13,
        11,
        6,
        3,
        2,
        2,
    )
    assert summary.win.rate == pytest.approx(6 / 11)
    assert (summary.win.low, summary.win.high) == pytest.approx(wilson_interval(6, 11))
    assert (summary.lose.low, summary.lose.high) == pytest.approx(wilson_interval(2, 11))
    assert summary.win_minus_loss.rate == pytest.approx(4 / 11)
    assert summary.win_minus_loss.low < 4 / 11 < summary.win_minus_loss.high


def test_summary_of_only_invalid_verdicts_has_no_rates() -> None:
    summary = summarise_outcomes([INVALID, INVALID], seed=0)
    assert summary.valid == 0 and summary.win is None and summary.win_minus_loss is None


def test_similar_length() -> None:
    assert is_similar_length(10, 12) and is_similar_length(0, 0)
    assert not is_similar_length(10, 13) and not is_similar_length(0, 1)


# ---- the report


def judged_pairs() -> list[JudgedPair]:
    """Model A wins the long-reply pairs and loses the similar-length ones: a verbosity win."""
    rows = []
    for i in range(8):
        rows.append(JudgedPair(f"long{i}", "harmless" if i % 2 else "helpful", 40, 10, A))
    for i in range(4):
        rows.append(JudgedPair(f"even{i}", "harmless", 20, 20, B if i < 3 else TIE))
    rows.append(JudgedPair("bad", "helpful", 5, 5, INVALID))
    return rows


def test_report_breaks_down_by_category_and_length() -> None:
    report = ppo_against_sft(judged_pairs(), seed=0, resamples=500)
    assert report.overall.wins == 8 and report.overall.losses == 3 and report.overall.invalid == 1
    assert set(report.by_category) == {"harmless", "helpful"}
    assert report.by_category["helpful"].wins == 4 and report.by_category["helpful"].invalid == 1
    assert report.by_category["harmless"].losses == 3
    assert report.length.mean_tokens_a == pytest.approx((8 * 40 + 4 * 20 + 5) / 13)
    similar = report.length.similar_length
    assert (similar.valid, similar.wins, similar.losses, similar.ties) == (4, 0, 3, 1)
    assert report.alignment_tax is None and report.agreement == []


def test_a_single_category_is_not_broken_down() -> None:
    rows = [JudgedPair(f"k{i}", "only", 3, 3, A) for i in range(3)]
    assert build_report(rows, RM_JUDGE, "a", "b", GENERATION, seed=0, resamples=100).by_category == {}


def test_agreement_with_other_judges() -> None:
    rows = judged_pairs()
    mine = {row.pair_key: row.verdict for row in rows}
    other = dict(mine)
    other["long0"], other["long1"] = TIE, B  # two disagreements
    other["even0"] = INVALID  # left out: not judged validly by both
    del other["long2"]  # left out: not judged by the other judge
    report = build_report(rows, RM_JUDGE, "a", "b", GENERATION, seed=0, other_judges={"LLM gpt": other}, resamples=100)
    (agreement,) = report.agreement
    shared = [key for key in mine if key in other and INVALID not in (mine[key], other[key])]
    assert agreement.pairs == len(shared) == 10
    assert agreement.percent == pytest.approx(8 / 10)
    expected_kappa = cohens_kappa([mine[k].value for k in shared], [other[k].value for k in shared])
    assert agreement.kappa == pytest.approx(expected_kappa)
    metrics = report.metrics()
    assert metrics["agreement/LLM gpt/percent"] == pytest.approx(0.8)


def reference_mean_interval(values: list[float], seed: int, resamples: int) -> tuple[float, float, float]:
    """The mean and its 95% percentile bootstrap interval by hand (resampled pairs, sorted means)."""
    return sum(values) / len(values), *bootstrap_by_loop(values, 0.95, resamples, seed)


def test_the_paired_mean_score_difference_and_its_interval() -> None:
    scores = [(1.5, 0.25), (0.0, 0.5), (2.0, -1.0), (0.75, 0.75), (-0.5, 0.25), (1.25, 0.0), (0.5, 0.125)]
    judgements = [
        Judgement(verdict=A if a > b else B if a < b else TIE, detail={"score_a": a, "score_b": b, "margin": a - b})
        for a, b in scores
    ]
    rows = [
        JudgedPair(f"k{i}", "only", 10, 10, judgement.verdict, judgement.score_diff)
        for i, judgement in enumerate(judgements)
    ]
    rows.append(JudgedPair("no-scores", "only", 10, 10, TIE))  # a pair the judge gave no scores for: left out
    report = ppo_against_sft(rows, seed=3, resamples=400)

    mean, low, high = reference_mean_interval([a - b for a, b in scores], seed=3, resamples=400)
    assert report.score_diff is not None and report.score_diff.pairs == len(scores)
    assert (report.score_diff.mean, report.score_diff.low, report.score_diff.high) == pytest.approx(
        (mean, low, high), abs=1e-12
    )
    metrics = report.metrics()
    assert (metrics["score_diff_mean"], metrics["score_diff_low"], metrics["score_diff_high"]) == pytest.approx(
        (mean, low, high), abs=1e-12
    )
    assert metrics["score_diff_pairs"] == len(scores)
    assert f"mean {mean:+.4g} (95% paired bootstrap interval {low:+.4g} to {high:+.4g}) over 7 pairs" in (
        render_markdown(report)
    )
    assert ppo_against_sft(rows, seed=3, resamples=400) == report  # seeded
    assert type(report).model_validate_json(report.model_dump_json()) == report


def test_a_judge_without_scores_reports_no_score_difference() -> None:
    assert Judgement(verdict=A, detail={"order_1": "A"}).score_diff is None
    report = ppo_against_sft(judged_pairs(), seed=0, resamples=100)
    assert report.score_diff is None
    assert not any(name.startswith("score_diff") for name in report.metrics())
    assert "Judge score of A's reply minus B's" not in render_markdown(report)


def test_metrics_markdown_and_chart(tmp_path: Path) -> None:
    tax = AlignmentTax(replies=13, perplexity_a=12.0, perplexity_b=10.0)
    report = ppo_against_sft(judged_pairs(), seed=0, alignment_tax=tax, resamples=500)
    metrics = report.metrics()
    assert metrics["win_rate"] == pytest.approx(8 / 12)
    assert metrics["win_minus_loss"] == pytest.approx(5 / 12)
    assert metrics["win_minus_loss_low"] <= metrics["win_minus_loss"] <= metrics["win_minus_loss_high"]
    assert metrics["invalid_pairs"] == 1 and metrics["judge_in_sample"] == 1.0
    assert metrics["alignment_tax"] == pytest.approx(2.0)
    assert metrics["category/harmless/lose_rate"] == pytest.approx(3 / 8)
    assert metrics["similar_length/win_rate"] == 0.0
    assert all(isinstance(value, float) and math.isfinite(value) for value in metrics.values())
    json.dumps(metrics, allow_nan=False)

    markdown = render_markdown(report)
    assert "**Judge:** the in-sample reward model: reward model rm-dir (IN-SAMPLE)" in markdown
    assert "In-sample judge" in markdown
    assert "| all | 12 | 66.7% (" in markdown and "+20.0%" in markdown  # alignment tax relative change
    assert "similar length (within 20%)" in markdown

    path = plot_win_tie_lose(report, tmp_path / "plots" / "win_rate.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in path.parent.iterdir()] == ["win_rate.png"]  # no temporary file left
    # report.json round-trips
    assert type(report).model_validate_json(report.model_dump_json()) == report


# ---- the length-controlled headline


def length_biased_pairs(count: int, seed: int) -> list[JudgedPair]:
    """A judge that mostly prefers the longer reply; A is usually longer; scores of B fall with length."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(count):
        tokens_a, tokens_b = int(rng.integers(20, 90)), int(rng.integers(10, 60))
        verdict = INVALID if i == 0 else TIE if i % 9 == 0 else A if tokens_a + rng.normal(0, 15) > tokens_b else B
        score_b = -0.02 * tokens_b + float(rng.normal(0, 0.3))
        rows.append(JudgedPair(f"k{i}", "only", tokens_a, tokens_b, verdict, 0.1, score_b))
    return rows


def length_biased_anchors(count: int, seed: int) -> list[list[JudgedPair]]:
    """Per prompt, two of B's replies against each other, judged by the same longer-is-better judge."""
    rng = np.random.default_rng(seed)
    anchors = []
    for i in range(count):
        tokens_a, tokens_b = int(rng.integers(10, 60)), int(rng.integers(10, 60))
        verdict = A if tokens_a + rng.normal(0, 15) > tokens_b else B
        anchors.append([JudgedPair(f"anchor{i}", "only", tokens_a, tokens_b, verdict)])
    return anchors


def reference_length_controlled(pairs: list[JudgedPair], anchors: list[tuple[JudgedPair]]) -> LengthControlledWinRate:
    """The length-controlled fit on the valid pairs, grouped by prompt, with the anchors at the report's
    thresholds (20 reaching, 10 informative), as the report below is asked to make it."""
    valid = [(prompt, pair) for prompt, pair in enumerate(pairs) if pair.verdict is not INVALID]
    return length_controlled_win_rate(
        [(pair.verdict.outcome + 1) / 2 for _, pair in valid],
        [pair.tokens_a - pair.tokens_b for _, pair in valid],
        resamples=300,
        seed=1,
        groups=[prompt for prompt, _ in valid],
        anchors=AnchorRows(
            [(row.verdict.outcome + 1) / 2 for (row,) in anchors],
            [row.tokens_a - row.tokens_b for (row,) in anchors],
            list(range(len(anchors))),
            20,
            10,
        ),
    )


def test_the_report_leads_with_the_length_controlled_figures() -> None:
    pairs = length_biased_pairs(80, seed=0)
    anchors = length_biased_anchors(80, seed=1)
    matched = [JudgedPair(f"m{i}", "only", 30, 28, [A, B, TIE][i % 3]) for i in range(61)]
    tax = AlignmentTax(replies=10, perplexity_a=11.0, perplexity_b=10.0)
    report = ppo_against_sft(
        pairs,
        seed=1,
        alignment_tax=tax,
        resamples=300,
        length_matched=matched,
        samples_per_model=4,
        anchor_pairs=anchors,
        min_anchor_pairs=20,
        min_informative_pairs=10,
    )
    expected = reference_length_controlled(pairs, anchors)
    assert expected.identifiable and expected.anchor_pairs == 80
    metrics = report.metrics()
    assert list(metrics)[:3] == ["lc_win_rate", "lc_win_rate_low", "lc_win_rate_high"]
    assert (metrics["lc_win_rate"], metrics["lc_win_rate_low"], metrics["lc_win_rate_high"]) == (
        expected.rate,
        expected.low,
        expected.high,
    )
    assert metrics["lc_pairs"] == 79 and metrics["lc_identifiable"] == 1 and metrics["lc_anchor_pairs"] == 80
    mean_a, mean_b = (sum(getattr(p, f"tokens_{x}") for p in pairs) / 80 for x in "ab")
    assert metrics["length_ratio"] == pytest.approx(mean_a / mean_b)
    assert metrics["length_matched/pairs"] == 61 and metrics["length_matched/win_rate"] == pytest.approx(21 / 61)
    assert metrics["length_matched/win_minus_loss"] == pytest.approx(1 / 61)
    assert metrics["length_matched/win_minus_loss_low"] <= 1 / 61 <= metrics["length_matched/win_minus_loss_high"]
    assert metrics["length_matched/samples_per_model"] == 4
    assert metrics["alignment_tax_relative"] == pytest.approx(0.1)
    assert metrics["judge/reward_length_spearman_b"] == pytest.approx(
        spearman([p.score_b for p in pairs], [p.tokens_b for p in pairs])
    )
    assert metrics["judge/reward_length_spearman_b"] < -0.5
    json.dumps(metrics, allow_nan=False)

    markdown = render_markdown(report)
    assert markdown.index("Length-controlled win rate of A: ") < markdown.index("Length-matched pairs: 61 valid")
    assert markdown.index("Length ratio A / B: ") < markdown.index("## Plain rates") < markdown.index("| all |")
    assert f"{expected.rate:.1%} (95% bootstrap interval {expected.low:.1%} to {expected.high:.1%})" in markdown
    assert "Few length-matched pairs" not in markdown
    assert "Few length-matched pairs (59 < 60)" in render_markdown(
        build_report(pairs, RM_JUDGE, "a", "b", GENERATION, seed=1, resamples=50, length_matched=matched[:59])
    )
    assert type(report).model_validate_json(report.model_dump_json()) == report


def test_without_enough_anchor_pairs_the_report_says_not_identifiable_and_gives_no_rate() -> None:
    pairs = length_biased_pairs(80, seed=0)
    for anchors, minimum, reason in (
        (None, 20, "no anchor pairs"),
        (length_biased_anchors(80, seed=1), 81, "anchor pairs reach the compared pairs' median |dlen|"),
    ):
        report = ppo_against_sft(pairs, seed=1, resamples=50, anchor_pairs=anchors, min_anchor_pairs=minimum)
        metrics = report.metrics()
        assert metrics["lc_identifiable"] == 0 and "lc_win_rate" not in metrics and "lc_win_rate_low" not in metrics
        line = next(line for line in render_markdown(report).splitlines() if "Length-controlled win rate" in line)
        assert "not identifiable" in line and reason in line and "%" not in line


def test_length_figures_of_degenerate_evaluations_stay_finite() -> None:
    ties = [JudgedPair(f"t{i}", "only", 10 + i, 12, TIE) for i in range(5)]
    anchors = [[JudgedPair(f"a{i}", "only", 10 + 2 * i, 12, TIE)] for i in range(5)]
    report = build_report(
        ties,
        RM_JUDGE,
        "a",
        "b",
        GENERATION,
        seed=0,
        resamples=50,
        length_matched=[],
        anchor_pairs=anchors,
        min_anchor_pairs=1,
    )
    metrics = report.metrics()
    assert (metrics["lc_win_rate"], metrics["lc_win_rate_low"], metrics["lc_win_rate_high"]) == (0.5, 0.5, 0.5)
    assert metrics["length_matched/pairs"] == 0 and "length_matched/win_rate" not in metrics
    assert "judge/reward_length_spearman_b" not in metrics  # no scores
    assert "Few length-matched pairs (0 < 60)" in render_markdown(report)

    invalid = build_report([JudgedPair("x", "only", 0, 0, INVALID)], RM_JUDGE, "a", "b", GENERATION, seed=0)
    assert invalid.length_controlled is None and invalid.length_matched is None
    assert "lc_win_rate" not in invalid.metrics() and "length_ratio" not in invalid.metrics()  # B's replies empty
    assert "n/a (no valid verdict)" in render_markdown(invalid)
    for figures in (metrics, invalid.metrics()):
        json.dumps(figures, allow_nan=False)


# ---- generation, perplexity


def test_generation_is_seeded_bounded_and_leaves_the_global_rng_alone(tiny) -> None:
    model, tokenizer = tiny
    prompts = [({"role": "user", "content": f"Question {i}?"},) for i in range(3)]
    state = torch.get_rng_state()
    first = generate_replies(model, tokenizer, prompts, GENERATION, batch_size=2, seed=11)
    assert torch.equal(torch.get_rng_state(), state)
    assert generate_replies(model, tokenizer, prompts, GENERATION, batch_size=2, seed=11) == first
    assert generate_replies(model, tokenizer, prompts, GENERATION, batch_size=2, seed=12) != first
    assert len(first) == 3
    for reply in first:
        assert reply.tokens <= GENERATION.max_new_tokens
        assert reply.finished or reply.tokens == GENERATION.max_new_tokens
        assert "<|im_end|>" not in reply.text


def reference_perplexity(model, tokenizer, examples) -> float:
    """exp(mean NLL of reply + end-of-turn tokens), one unpadded sequence at a time."""
    nll, count = 0.0, 0
    for prompt, reply in examples:
        encoded = encode_conversation(tokenizer, prompt, reply)
        ids = torch.tensor([encoded.input_ids])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0]
        for position in range(encoded.reply_start, len(encoded.input_ids)):
            nll -= F.log_softmax(logits[position - 1].double(), dim=-1)[encoded.input_ids[position]].item()
            count += 1
    return math.exp(nll / count)


def test_reply_perplexity_matches_a_plain_loop(tiny) -> None:
    model, tokenizer = tiny
    examples = [
        (({"role": "user", "content": "Hi?"},), "Hello there."),
        (({"role": "user", "content": "What is the capital of Italy, please?"},), "Rome."),
        (({"role": "user", "content": "Count."},), "One, two, three, four, five."),
    ]
    value, measured = reply_perplexity(model, tokenizer, examples, max_length=256, batch_size=2)
    assert measured == 3
    assert value == pytest.approx(reference_perplexity(model, tokenizer, examples), rel=1e-4)
    assert AlignmentTax(3, perplexity_a=value * 1.5, perplexity_b=value).relative_change == pytest.approx(0.5)


# ---- prompts and model directories


def test_evaluation_prompts_are_distinct_capped_and_categorised(tmp_path: Path) -> None:
    harmless, helpful = tmp_path / "harmless-base.jsonl", tmp_path / "helpful-base.jsonl.gz"

    def row(i: int, answer: str) -> str:
        prompt = f"\n\nHuman: Question {i}?"
        return json.dumps(
            {"chosen": f"{prompt}\n\nAssistant: {answer} {i}.", "rejected": f"{prompt}\n\nAssistant: No."}
        )

    harmless.write_text("".join(row(i, "Yes") + "\n" + row(i, "Sure") + "\n" for i in range(40)))
    with gzip.open(helpful, "wt") as file:
        file.write("".join(row(i, "Indeed") + "\n" for i in range(40, 80)))
    settings = DataConfig(eval_fraction=0.3, max_drop_fraction=0.9)
    prepare_preference_data([harmless, helpful], tmp_path / "data", settings, lambda pair: TokenLengths(5, 10, 10))

    prompts = evaluation_prompts(tmp_path / "data", max_prompts=1000)
    ids = [prompt.prompt_id for prompt in prompts]
    assert len(ids) == len(set(ids)) > 4  # questions 0-39 appear in two pairs each, once here
    assert ids == sorted(ids)  # by prompt id: independent of the order of the input files
    assert {prompt.category for prompt in prompts} == {"harmless-base", "helpful-base"}
    assert [p.prompt_id for p in evaluation_prompts(tmp_path / "data", max_prompts=3)] == ids[:3]
    assert category_of("Anthropic/hh-rlhf") == "Anthropic/hh-rlhf"


def test_resolve_model_dir(tmp_path: Path) -> None:
    stage = tmp_path / "ppo"
    (stage / "model").mkdir(parents=True)
    (stage / "model" / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="unfinished"):
        resolve_model_dir(stage)
    (stage / "metrics.json").write_text("{}")
    assert resolve_model_dir(stage) == stage / "model"
    assert resolve_model_dir(stage / "model") == stage / "model"
    with pytest.raises(FileNotFoundError, match="neither a stage output"):
        resolve_model_dir(tmp_path / "nothing")
    with pytest.raises(ValueError, match="MLflow registry URI"):
        resolve_model_dir("models:/rlhf-policy@champion")


def test_report_rejects_no_pairs() -> None:
    with pytest.raises(ValueError, match="no judged pairs"):
        build_report([], RM_JUDGE, "a", "b", GENERATION, seed=0)


def test_outcome_values() -> None:
    assert [v.outcome for v in (A, TIE, B)] == [1, 0, -1]
    with pytest.raises(ValueError, match="invalid"):
        _ = INVALID.outcome
    assert np.mean([v.outcome for v in (A, A, B, TIE)]) == pytest.approx(0.25)
