"""Token-length and duplicate checks, drop accounting, and the run-level drop-fraction bound."""

from __future__ import annotations

import pytest

from rlhf_core.data.records import Drop, DropReason, PreferencePair
from rlhf_core.data.validation import (
    EXAMPLES_PER_REASON,
    DataValidationError,
    DropLog,
    DuplicateFilter,
    TokenLengths,
    check_drop_fraction,
    check_token_length,
)


def pair(line: int, chosen: str = "yes", prompt: str = "q") -> PreferencePair:
    return PreferencePair(({"role": "user", "content": prompt},), chosen, "no", "in.jsonl", line)


@pytest.mark.parametrize(
    ("lengths", "max_prompt", "dropped"),
    [
        (TokenLengths(10, 50, 40), None, False),
        (TokenLengths(10, 51, 40), None, True),  # longer side over max_total_tokens=50
        (TokenLengths(10, 40, 51), None, True),  # the rejected side counts too
        (TokenLengths(30, 45, 40), 30, False),
        (TokenLengths(31, 45, 40), 30, True),  # prompt over max_prompt_tokens
    ],
)
def test_check_token_length(lengths: TokenLengths, max_prompt: int | None, dropped: bool) -> None:
    drop = check_token_length(pair(3), lengths, max_total_tokens=50, max_prompt_tokens=max_prompt)
    assert (drop is not None) == dropped
    if drop is not None:
        assert (drop.reason, drop.source, drop.line) == (DropReason.TOO_LONG, "in.jsonl", 3)


def test_duplicate_filter_keeps_first_and_names_it() -> None:
    duplicates = DuplicateFilter()
    assert duplicates.check(pair(1)) is None
    assert duplicates.check(pair(2, chosen="other")) is None
    assert duplicates.check(pair(3, prompt="  Q ")) is not None  # same normalised prompt and replies
    drop = duplicates.check(pair(4))
    assert drop is not None and drop.reason is DropReason.DUPLICATE_PAIR and drop.line == 4
    assert "in.jsonl line 1" in drop.detail


def test_drop_log_counts_every_drop_and_keeps_the_first_examples() -> None:
    log = DropLog()
    for line in range(1, 9):
        log.add(Drop(DropReason.EMPTY_REPLY, "empty", "in.jsonl", line))
    log.add(Drop(DropReason.TOO_LONG, "long", "in.jsonl", 20))
    assert log.counts == {DropReason.EMPTY_REPLY: 8, DropReason.TOO_LONG: 1}
    assert log.total == 9
    assert [drop.line for drop in log.examples[DropReason.EMPTY_REPLY]] == list(range(1, EXAMPLES_PER_REASON + 1))


def test_check_drop_fraction_passes_at_the_bound_and_fails_above_it() -> None:
    log = DropLog()
    for line in range(3):
        log.add(Drop(DropReason.MALFORMED_JSON, "bad", "in.jsonl", line))
    check_drop_fraction(kept=7, drops=log, sources=["in.jsonl"], max_drop_fraction=0.3)
    with pytest.raises(DataValidationError) as error:
        check_drop_fraction(kept=7, drops=log, sources=["in.jsonl"], max_drop_fraction=0.29)
    message = str(error.value)
    assert "in.jsonl" in message and "kept 7/10" in message and "malformed_json=3" in message


def test_nothing_kept_always_fails() -> None:
    log = DropLog()
    log.add(Drop(DropReason.MISSING_FIELD, "x", "a.json", 1))
    with pytest.raises(DataValidationError, match=r"no valid preference pairs remain; kept 0/1 .*missing_field=1"):
        check_drop_fraction(kept=0, drops=log, sources=["a.json"], max_drop_fraction=1.0)


def test_the_failure_names_the_first_rows_of_each_reason_with_their_field() -> None:
    log = DropLog()
    for line in (3, 8, 9, 12):
        log.add(Drop(DropReason.MISSING_FIELD, "missing field 'chosen'", "in.jsonl", line))
    log.add(Drop(DropReason.WRONG_TYPE, "field 'rejected' is a number, expected a string", "in.jsonl", 5))
    with pytest.raises(DataValidationError) as error:
        check_drop_fraction(kept=1, drops=log, sources=["in.jsonl"], max_drop_fraction=0.5)
    assert str(error.value).endswith(
        "drops by reason: missing_field=4, wrong_type=1; first dropped rows: missing_field: in.jsonl line 3 "
        "(missing field 'chosen'), in.jsonl line 8 (missing field 'chosen'), in.jsonl line 9 (missing field "
        "'chosen'); wrong_type: in.jsonl line 5 (field 'rejected' is a number, expected a string)"
    )
