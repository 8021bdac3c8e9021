"""The human judge without a Prefect server: the seeded, recorded order of the replies, un-swapping,
the answers file (durable appends, torn last line, resume position), the session directory checks,
the form a batch becomes, the verdict rows and report of a finished session, and the flow's settings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from flows.human_eval import HumanEvalSettings
from rlhf_core.config import Config
from rlhf_core.evaluation.judges.human import (
    ANSWERS_FILE,
    INSTRUCTIONS,
    PAIRS_FILE,
    PLAN_FILE,
    HumanAnswer,
    Preference,
    as_text,
    batches,
    load_session,
    open_session,
    pair_markdown,
    plan_session,
    read_answers,
    unswap,
)
from rlhf_core.evaluation.judges.verdicts import Verdict
from rlhf_core.evaluation.outputs import read_generations, read_verdicts, write_jsonl
from tasks.evaluation.human_eval import (
    answer_form,
    answers_from_form,
    choice_field,
    comment_field,
    pause_key,
    write_results,
)


def generation_row(index: int, category: str = "harmless-base") -> dict:
    return {
        "prompt_id": f"prompt-{index:02d}",
        "category": category,
        "prompt": [{"role": "user", "content": f"Question number {index}?"}],
        "reply_a": f"Model A answers question {index}.",
        "reply_b": f"Model B answers question {index}.",
        "tokens_a": 5 + index,
        "tokens_b": 5,
        "finished_a": True,
        "finished_b": True,
    }


def write_generations(path: Path, count: int) -> Path:
    categories = ("harmless-base", "helpful-base")
    return write_jsonl(path, [generation_row(index, categories[index % 2]) for index in range(count)])


def answer(pair_key: str, choice: Preference, comment: str = "", session: str = "s1") -> HumanAnswer:
    return HumanAnswer(
        pair_key=pair_key,
        prompt_id="p",
        choice=choice,
        comment=comment,
        answered_at="2025-01-01T00:00:00+00:00",
        session=session,
    )


# ---- order and un-swapping


def test_order_is_seeded_and_fair(tmp_path: Path) -> None:
    pairs = read_generations(write_generations(tmp_path / "g.jsonl", 200))
    flips = [pair.swapped for pair in plan_session(pairs, seed=7).pairs]
    assert flips == [pair.swapped for pair in plan_session(pairs, seed=7).pairs]
    assert flips != [pair.swapped for pair in plan_session(pairs, seed=8).pairs]
    assert 70 < sum(flips) < 130  # a fair coin: 100 expected, sd 7
    plan = plan_session(pairs, seed=7)
    assert [pair.position for pair in plan.pairs] == list(range(1, 201))
    assert [pair.pair_key for pair in plan.pairs] == [item.pair.pair_key for item in pairs]


def test_duplicate_pairs_are_refused(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "g.jsonl", [generation_row(1), generation_row(1)])
    with pytest.raises(ValueError, match="more than once"):
        plan_session(read_generations(path), seed=0)


@pytest.mark.parametrize(
    ("choice", "swapped", "verdict"),
    [
        (Preference.REPLY_1, False, Verdict.A),
        (Preference.REPLY_2, False, Verdict.B),
        (Preference.REPLY_1, True, Verdict.B),  # model B's reply was shown first
        (Preference.REPLY_2, True, Verdict.A),
        (Preference.TIE, False, Verdict.TIE),
        (Preference.TIE, True, Verdict.TIE),
    ],
)
def test_unswap(choice: Preference, swapped: bool, verdict: Verdict) -> None:
    assert unswap(choice, swapped) is verdict


def test_the_form_shows_the_replies_in_the_recorded_order(tmp_path: Path) -> None:
    session = open_session(tmp_path / "s", write_generations(tmp_path / "g.jsonl", 8), seed=3)
    for shown in session.shown():
        text = pair_markdown(shown)
        first, second = text.index("### Reply 1"), text.index("### Reply 2")
        position_a = text.index(as_text(shown.generated.pair.reply_a))
        position_b = text.index(as_text(shown.generated.pair.reply_b))
        a_first = first < position_a < second < position_b
        b_first = first < position_b < second < position_a
        assert (b_first, a_first) == (shown.planned.swapped, not shown.planned.swapped)
        assert as_text(shown.generated.pair.prompt[0]["content"]) in text


def test_markup_in_a_reply_is_shown_as_written() -> None:
    reply = "# Not a heading\n\n1. not a list\n**Reply 2** <b>x</b>"
    assert as_text(reply).split("\n\n") == [r"\# Not a heading", r"1\. not a list", r"\*\*Reply 2\*\* \<b\>x\</b\>"]
    assert as_text("  ") == "*(empty reply)*"


# ---- the session directory and resuming


def test_session_records_its_plan_and_resumes_at_the_first_unanswered_pair(tmp_path: Path) -> None:
    generations = write_generations(tmp_path / "g.jsonl", 5)
    out = tmp_path / "session"
    session = open_session(out, generations, seed=11)
    assert (out / PAIRS_FILE).read_text() == generations.read_text()
    recorded = json.loads((out / PLAN_FILE).read_text())
    assert recorded["seed"] == 11
    assert [pair["swapped"] for pair in recorded["pairs"]] == [
        pair.swapped for pair in plan_session(read_generations(generations), 11).pairs
    ]
    assert [shown.planned.position for shown in session.pending()] == [1, 2, 3, 4, 5]

    keys = [pair.pair_key for pair in session.plan.pairs]
    session.record([answer(keys[0], Preference.REPLY_1), answer(keys[2], Preference.TIE)])
    resumed = open_session(out, generations, seed=999)  # another seed: the recorded order stays
    assert resumed.plan == session.plan
    assert [shown.planned.position for shown in resumed.pending()] == [2, 4, 5]
    assert load_session(out).plan == session.plan


def test_a_torn_last_line_is_dropped_and_the_next_answer_starts_a_fresh_line(tmp_path: Path) -> None:
    generations = write_generations(tmp_path / "g.jsonl", 3)
    out = tmp_path / "session"
    session = open_session(out, generations, seed=0)
    keys = [pair.pair_key for pair in session.plan.pairs]
    session.record([answer(keys[0], Preference.REPLY_2)])
    with (out / ANSWERS_FILE).open("a") as file:
        file.write(answer(keys[1], Preference.REPLY_1).model_dump_json()[:40])  # crashed mid-append
    assert set(read_answers(out / ANSWERS_FILE)) == {keys[0]}

    session = open_session(out, generations, seed=0)
    session.record([answer(keys[1], Preference.TIE)])
    lines = (out / ANSWERS_FILE).read_text().splitlines()
    assert [json.loads(line)["choice"] for line in lines] == ["reply 2", "tie"]


def test_the_first_answer_of_a_pair_counts(tmp_path: Path) -> None:
    session = open_session(tmp_path / "s", write_generations(tmp_path / "g.jsonl", 2), seed=0)
    key = session.plan.pairs[0].pair_key
    session.record([answer(key, Preference.REPLY_1, session="first")])
    session.record([answer(key, Preference.REPLY_2, session="second")])
    assert read_answers(session.answers_path)[key].session == "first"


def test_a_session_on_other_pairs_or_another_judges_directory_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "session"
    open_session(out, write_generations(tmp_path / "g.jsonl", 3), seed=0)
    with pytest.raises(ValueError, match="other pairs"):
        open_session(out, write_generations(tmp_path / "other.jsonl", 4), seed=0)

    rm_dir = tmp_path / "eval"
    generations = write_generations(rm_dir / "generations.jsonl", 2)
    write_jsonl(rm_dir / "verdicts.jsonl", [{"pair_key": "k", "judge": "reward model", "verdict": "A"}])
    with pytest.raises(ValueError, match="reward model judge's evaluation"):
        open_session(rm_dir, generations, seed=0)


def test_answers_about_unknown_pairs_are_refused(tmp_path: Path) -> None:
    session = open_session(tmp_path / "s", write_generations(tmp_path / "g.jsonl", 2), seed=0)
    with pytest.raises(ValueError, match="not in this session"):
        session.record([answer("not-a-pair", Preference.TIE)])


# ---- forms


def test_batches() -> None:
    assert batches([1, 2, 3, 4, 5], 2) == [[1, 2], [3, 4], [5]]
    assert batches([], 3) == []
    with pytest.raises(ValueError):
        batches([1], 0)


def test_a_batch_form_has_a_choice_and_comment_per_pair_and_the_pairs_as_description(tmp_path: Path) -> None:
    session = open_session(tmp_path / "s", write_generations(tmp_path / "g.jsonl", 4), seed=5)
    batch = session.shown()[1:3]
    form = answer_form(batch, total=4)
    assert set(form.model_fields) == {"choice_2", "comment_2", "choice_3", "comment_3"}
    # each pair is shown with its question, where the UI renders a field's description; the instructions
    # with the first
    for shown in batch:
        question = form.model_fields[choice_field(shown.planned.position)]
        assert question.title == f"Pair {shown.planned.position} of 4: which reply is better?"
        assert question.description == pair_markdown(shown, instructions=shown is batch[0])
    assert INSTRUCTIONS in form.model_fields["choice_2"].description
    assert INSTRUCTIONS not in form.model_fields["choice_3"].description
    assert pause_key(batch) == "pairs-2-3"
    with pytest.raises(ValidationError):
        form(choice_2="reply 1")  # choice_3 missing
    with pytest.raises(ValidationError):
        form(choice_2="A better", choice_3="tie")

    filled = form(choice_2="reply 1", choice_3="tie", comment_3="  both fine ")
    answers = answers_from_form(filled, batch, session="run-1")
    assert [(item.pair_key, item.choice, item.comment) for item in answers] == [
        (batch[0].planned.pair_key, Preference.REPLY_1, ""),
        (batch[1].planned.pair_key, Preference.TIE, "both fine"),
    ]
    assert (choice_field(2), comment_field(2)) == ("choice_2", "comment_2")


# ---- results


def test_a_finished_session_writes_verdicts_and_report_like_the_other_judges(tmp_path: Path) -> None:
    out = tmp_path / "session"
    session = open_session(out, write_generations(tmp_path / "g.jsonl", 6), seed=2)
    choices = [
        Preference.REPLY_1,
        Preference.REPLY_1,
        Preference.REPLY_2,
        Preference.TIE,
        Preference.REPLY_2,
        Preference.REPLY_1,
    ]
    with pytest.raises(ValueError, match="no answer yet"):
        session.judgements()
    session.record([answer(pair.pair_key, choice) for pair, choice in zip(session.plan.pairs, choices, strict=True)])
    expected = [unswap(choice, pair.swapped) for pair, choice in zip(session.plan.pairs, choices, strict=True)]

    report = write_results(session, Config(), "ppo", "sft", other_judges={})
    judge, verdicts = read_verdicts(out / "verdicts.jsonl")
    assert judge == "human"
    assert [verdicts[pair.pair_key] for pair in session.plan.pairs] == expected
    rows = [json.loads(line) for line in (out / "verdicts.jsonl").read_text().splitlines()]
    assert [(row["choice"], row["swapped"]) for row in rows] == [
        (c.value, p.swapped) for p, c in zip(session.plan.pairs, choices)
    ]
    assert (report.overall.wins, report.overall.ties, report.overall.losses) == (
        expected.count(Verdict.A),
        expected.count(Verdict.TIE),
        expected.count(Verdict.B),
    )
    assert report.judge.kind == "human" and not report.judge.in_sample
    assert report.judge.figures["pairs_shown_swapped"] == sum(pair.swapped for pair in session.plan.pairs)
    assert set(report.by_category) == {"harmless-base", "helpful-base"}
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["pairs"] == 6 and metrics["judge/answered_pairs"] == 6
    # people are shown no anchor pairs (the baseline against itself), so the length-controlled win rate is
    # not identifiable from their verdicts: said so, no number (and no length-matched pairs: none were asked)
    assert metrics["lc_identifiable"] == 0 and "lc_win_rate" not in metrics and "lc_win_rate_low" not in metrics
    assert metrics["lc_pairs"] == 6 and metrics["length_ratio"] == pytest.approx(report.length.length_ratio)
    assert not any(name.startswith("length_matched/") for name in metrics)
    markdown = (out / "report.md").read_text()
    assert markdown.startswith("# Evaluation: ppo (A) vs sft (B)")
    assert markdown.index("Length-controlled win rate of A: ") < markdown.index("## Plain rates")
    assert (out / "plots" / "win_rate.png").stat().st_size > 0


def test_people_judge_the_length_matched_pairs_after_the_main_ones(tmp_path: Path) -> None:
    generations = write_generations(tmp_path / "g.jsonl", 4)
    main_row = generation_row(0)  # prompt 0's closest-length pair is its main pair: asked once
    other = {**generation_row(1), "reply_a": "Model A's second reply to question 1.", "tokens_a": 5}
    matched = write_jsonl(
        tmp_path / "generations_matched.jsonl",
        [{**main_row, "sample_a": 0, "sample_b": 0}, {**other, "sample_a": 1, "sample_b": 0}],
    )
    out = tmp_path / "session"
    session = open_session(out, generations, seed=4, matched=matched)
    keys = [item.pair.pair_key for item in read_generations(generations)]
    matched_keys = [item.pair.pair_key for item in read_generations(matched)]
    assert matched_keys[0] == keys[0]
    assert [pair.pair_key for pair in session.plan.pairs] == [*keys, matched_keys[1]]
    assert load_session(out).matched == session.matched  # the copy in the session directory is kept

    session.record([answer(pair.pair_key, Preference.TIE) for pair in session.plan.pairs])
    report = write_results(session, Config(), "ppo", "sft", other_judges={})
    assert report.length_matched is not None and report.length_matched.outcome.ties == 2
    _, verdicts = read_verdicts(out / "verdicts_matched.jsonl")
    assert set(verdicts) == set(matched_keys) and set(verdicts.values()) == {Verdict.TIE}
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["length_matched/pairs"] == 2 and metrics["lc_identifiable"] == 0  # no anchor pairs shown
    assert "Few length-matched pairs (2 < 60)" in (out / "report.md").read_text()


# ---- the flow's settings


def test_settings_need_exactly_one_source_of_pairs() -> None:
    HumanEvalSettings(out_dir="s", generations="g.jsonl")
    HumanEvalSettings(out_dir="s", data_dir="d", model_a="a", model_b="b")
    with pytest.raises(ValidationError, match="give the pairs"):
        HumanEvalSettings(out_dir="s")
    with pytest.raises(ValidationError, match="not both"):
        HumanEvalSettings(out_dir="s", generations="g.jsonl", data_dir="d", model_a="a", model_b="b")
    with pytest.raises(ValidationError, match="model_a and model_b"):
        HumanEvalSettings(out_dir="s", data_dir="d", model_a="a")
    with pytest.raises(ValidationError):
        HumanEvalSettings(out_dir="s", generations="g.jsonl", batch_size=0)
