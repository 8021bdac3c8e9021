"""Parsing rows of each public preference format into PreferencePairs, and every drop reason of a row."""

from __future__ import annotations

import hashlib

import pytest

from fixtures.pairs import hh
from rlhf_core.data.formats import PreferenceFormat, detect_format, parse_row
from rlhf_core.data.records import Drop, DropReason, PreferencePair


def parse(row: dict) -> PreferencePair | Drop:
    return parse_row(row, source="test.jsonl", line=7)


def reason_of(row: dict) -> DropReason:
    result = parse(row)
    assert isinstance(result, Drop), f"expected a drop, got {result}"
    assert result.source == "test.jsonl" and result.line == 7
    return result.reason


def test_hh_multi_turn_transcript_becomes_prompt_messages_and_two_replies() -> None:
    shared = [("Human", "How do I bake bread?"), ("Assistant", "Do you have yeast?"), ("Human", "Yes.\nLots.")]
    row = {
        "chosen": hh(*shared, ("Assistant", "Mix flour, water and yeast, then knead.")),
        "rejected": hh(*shared, ("Assistant", "Buy some.")),
    }
    pair = parse(row)
    assert isinstance(pair, PreferencePair)
    assert pair.prompt == (
        {"role": "user", "content": "How do I bake bread?"},
        {"role": "assistant", "content": "Do you have yeast?"},
        {"role": "user", "content": "Yes.\nLots."},
    )
    assert pair.chosen == "Mix flour, water and yeast, then knead."
    assert pair.rejected == "Buy some."
    assert (pair.source, pair.line) == ("test.jsonl", 7)


def test_hh_transcript_without_leading_blank_line_is_accepted() -> None:
    row = {"chosen": "Human: hi\n\nAssistant: hello", "rejected": "Human: hi\n\nAssistant: go away"}
    pair = parse(row)
    assert isinstance(pair, PreferencePair)
    assert pair.prompt == ({"role": "user", "content": "hi"},)


def test_prompt_chosen_rejected_with_strings() -> None:
    pair = parse({"prompt": "  What is 2+2? ", "chosen": "4", "rejected": " 5 "})
    assert isinstance(pair, PreferencePair)
    assert pair.prompt == ({"role": "user", "content": "What is 2+2?"},)
    assert (pair.chosen, pair.rejected) == ("4", "5")


def test_prompt_chosen_rejected_with_message_lists_takes_final_assistant_message() -> None:
    prompt = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of France?"}]
    row = {
        "prompt": prompt,
        "chosen": [{"role": "assistant", "content": "Paris."}],
        # UltraFeedback style: the reply list repeats the prompt before the reply.
        "rejected": [*prompt, {"role": "assistant", "content": "Lyon."}],
    }
    pair = parse(row)
    assert isinstance(pair, PreferencePair)
    assert pair.prompt == tuple(prompt)
    assert (pair.chosen, pair.rejected) == ("Paris.", "Lyon.")


def test_implicit_prompt_message_lists_share_their_context() -> None:
    context = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "Tell a joke"},
    ]
    row = {
        "chosen": [*context, {"role": "assistant", "content": "Knock knock."}],
        "rejected": [*context, {"role": "assistant", "content": "No."}],
    }
    assert detect_format(row) is PreferenceFormat.PROMPT_CHOSEN_REJECTED
    pair = parse(row)
    assert isinstance(pair, PreferencePair)
    assert pair.prompt == tuple(context)
    assert (pair.chosen, pair.rejected) == ("Knock knock.", "No.")


def test_prompt_string_in_hh_transcript_form_is_parsed_into_turns() -> None:
    row = {
        "prompt": "\n\nHuman: Hi\n\nAssistant: Hello\n\nHuman: Help me\n\nAssistant:",
        "chosen": " Sure.",
        "rejected": "No.",
    }
    pair = parse(row)
    assert isinstance(pair, PreferencePair)
    assert pair.prompt == (
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "Help me"},
    )
    assert pair.chosen == "Sure."


def test_detect_format_by_keys() -> None:
    assert detect_format({"chosen": "a", "rejected": "b"}) is PreferenceFormat.HH_TRANSCRIPT
    assert detect_format({"prompt": "p", "chosen": "a", "rejected": "b"}) is PreferenceFormat.PROMPT_CHOSEN_REJECTED
    assert detect_format({"question": "p"}) is None


SHARED = [("Human", "q1"), ("Assistant", "a1"), ("Human", "q2")]


# A row of each kind that is dropped, and the reason it is dropped for.
BAD_ROWS = [
    ({"chosen": hh(("Human", "q"), ("Assistant", "a"))}, DropReason.MISSING_FIELD),
    ({"text": "hello"}, DropReason.MISSING_FIELD),
    ({"chosen": 3, "rejected": "x"}, DropReason.WRONG_TYPE),
    ({"prompt": 5, "chosen": "a", "rejected": "b"}, DropReason.WRONG_TYPE),
    ({"prompt": "p", "chosen": {"text": "a"}, "rejected": "b"}, DropReason.WRONG_TYPE),
    ({"prompt": None, "chosen": "a", "rejected": "b"}, DropReason.MISSING_FIELD),
    ({"chosen": hh(*SHARED, ("Assistant", "")), "rejected": hh(*SHARED, ("Assistant", "b"))}, DropReason.EMPTY_REPLY),
    ({"prompt": "p", "chosen": "a", "rejected": "   "}, DropReason.EMPTY_REPLY),
    (
        {"chosen": hh(*SHARED, ("Assistant", "same")), "rejected": hh(*SHARED, ("Assistant", "same "))},
        DropReason.IDENTICAL_REPLIES,
    ),
    ({"prompt": "p", "chosen": "x", "rejected": "x"}, DropReason.IDENTICAL_REPLIES),
    (
        {
            "chosen": hh(*SHARED, ("Assistant", "a")),
            "rejected": hh(("Human", "other"), ("Assistant", "a1"), ("Human", "q2"), ("Assistant", "b")),
        },
        DropReason.PROMPT_MISMATCH,
    ),
    (
        {
            "prompt": "p",
            "chosen": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
            "rejected": "b",
        },
        DropReason.PROMPT_MISMATCH,
    ),
    ({"chosen": "no turns at all", "rejected": "none here either"}, DropReason.MALFORMED_TURNS),
    (
        {
            "chosen": "preamble" + hh(("Human", "q"), ("Assistant", "a")),
            "rejected": "preamble" + hh(("Human", "q"), ("Assistant", "b")),
        },
        DropReason.MALFORMED_TURNS,
    ),
    (
        {
            "chosen": hh(("Human", "q"), ("Human", "q"), ("Assistant", "a")),
            "rejected": hh(("Human", "q"), ("Human", "q"), ("Assistant", "b")),
        },
        DropReason.MALFORMED_TURNS,
    ),
    (
        {
            "chosen": hh(("Human", "q"), ("Assistant", "a"), ("Human", "more")),
            "rejected": hh(("Human", "q"), ("Assistant", "b")),
        },
        DropReason.MALFORMED_TURNS,
    ),
    (
        {"chosen": hh(("Human", ""), ("Assistant", "a")), "rejected": hh(("Human", ""), ("Assistant", "b"))},
        DropReason.MALFORMED_TURNS,
    ),
    (
        {
            "chosen": hh(("Assistant", "hi"), ("Assistant", "a")),
            "rejected": hh(("Assistant", "hi"), ("Assistant", "b")),
        },
        DropReason.MALFORMED_TURNS,
    ),
    ({"prompt": [{"role": "bot", "content": "q"}], "chosen": "a", "rejected": "b"}, DropReason.MALFORMED_TURNS),
    (
        {
            "prompt": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
            "chosen": "a",
            "rejected": "b",
        },
        DropReason.MALFORMED_TURNS,
    ),
    ({"prompt": "p", "chosen": [{"role": "user", "content": "a"}], "rejected": "b"}, DropReason.MALFORMED_TURNS),
    ({"prompt": ["just a string"], "chosen": "a", "rejected": "b"}, DropReason.MALFORMED_TURNS),
]


@pytest.mark.parametrize(("row", "reason"), BAD_ROWS)
def test_bad_rows_are_dropped_with_their_reason(row: dict, reason: DropReason) -> None:
    assert reason_of(row) is reason


def test_drop_detail_names_the_problem() -> None:
    result = parse(
        {
            "chosen": hh(("Human", "q"), ("Human", "q"), ("Assistant", "a")),
            "rejected": hh(("Human", "q"), ("Assistant", "b")),
        }
    )
    assert isinstance(result, Drop)
    assert "chosen" in result.detail and "user" in result.detail


def reference_prompt_id(messages: list[tuple[str, str]]) -> str:
    text = "\n".join(f"{role}: {' '.join(content.split()).lower()}" for role, content in messages)
    return hashlib.sha256(text.encode()).hexdigest()


def test_prompt_id_ignores_whitespace_and_case_but_not_roles() -> None:
    a = parse({"prompt": "How do I  bake\nbread?", "chosen": "x", "rejected": "y"})
    b = parse({"prompt": " how do i bake bread? ", "chosen": "x", "rejected": "z"})
    c = parse(
        {
            "prompt": [{"role": "system", "content": "How do I bake bread?"}, {"role": "user", "content": "ok"}],
            "chosen": "x",
            "rejected": "y",
        }
    )
    assert isinstance(a, PreferencePair) and isinstance(b, PreferencePair) and isinstance(c, PreferencePair)
    assert a.prompt_id == b.prompt_id == reference_prompt_id([("user", "how do i bake bread?")])
    assert c.prompt_id == reference_prompt_id([("system", "how do i bake bread?"), ("user", "ok")])
    assert a.pair_id != b.pair_id  # different rejected reply: a different judgement
    assert a.pair_id == parse({"prompt": "HOW do I bake bread?", "chosen": "x", "rejected": "y"}).pair_id


@pytest.mark.parametrize(
    ("value", "named"), [(3, "a number"), (2.5, "a number"), (True, "a boolean"), ({"text": "a"}, "an object")]
)
def test_a_wrong_type_is_named_as_json_names_it(value: object, named: str) -> None:
    drop = parse_row({"prompt": "p", "chosen": "a", "rejected": value}, "in.jsonl", 1)
    assert isinstance(drop, Drop) and drop.reason is DropReason.WRONG_TYPE
    assert drop.detail == f"field 'rejected' is {named}, expected a string or a list of messages"
