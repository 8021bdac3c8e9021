"""Checks on parsed pairs (token length, duplicates), drop accounting, and the run-level drop bound.

Token lengths come from a caller-supplied function so that this module stays free of tokenizers: the
pipeline stage passes one built from the policy's tokenizer and chat template (the lengths that matter
are those the trainer will see), tests pass a whitespace word counter.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from rlhf_core.data.records import Drop, DropReason, PreferencePair

EXAMPLES_PER_REASON = 5
EXAMPLES_IN_MESSAGE = 3  # per reason, in the error message (the report holds EXAMPLES_PER_REASON)


class TokenLengths(NamedTuple):
    """Token counts of one pair as the trainer will see it: the prompt, and prompt + each reply.

    `prompt_and_chosen`/`prompt_and_rejected` are lengths of the whole templated conversation, which is
    what must fit in the model's context; the reply alone is `prompt_and_chosen - prompt`.
    """

    prompt: int
    prompt_and_chosen: int
    prompt_and_rejected: int

    @property
    def longest_total(self) -> int:
        return max(self.prompt_and_chosen, self.prompt_and_rejected)


TokenLengthFn = Callable[[PreferencePair], TokenLengths]


class DataValidationError(Exception):
    """The input as a whole is unusable: nothing valid remains, or too large a share of it was dropped."""


def check_token_length(
    pair: PreferencePair, lengths: TokenLengths, max_total_tokens: int, max_prompt_tokens: int | None
) -> Drop | None:
    """A too_long Drop when the longer side, or the prompt, exceeds its limit; otherwise None.

    Pairs are dropped rather than truncated: a truncated reply is no longer the reply the human judged.
    """
    if lengths.longest_total > max_total_tokens:
        detail = f"{lengths.longest_total} tokens in prompt + longer reply > max_total_tokens={max_total_tokens}"
    elif max_prompt_tokens is not None and lengths.prompt > max_prompt_tokens:
        detail = f"{lengths.prompt} prompt tokens > max_prompt_tokens={max_prompt_tokens}"
    else:
        return None
    return Drop(reason=DropReason.TOO_LONG, detail=detail, source=pair.source, line=pair.line)


@dataclass
class DuplicateFilter:
    """Remembers every pair_id seen, so a repeated judgement is dropped and the first copy kept."""

    _first_seen: dict[str, tuple[str, int]] = field(default_factory=dict)

    def check(self, pair: PreferencePair) -> Drop | None:
        """A duplicate_pair Drop naming the first copy if this pair was seen before; otherwise None."""
        first = self._first_seen.setdefault(pair.pair_id, (pair.source, pair.line))
        if first == (pair.source, pair.line):
            return None
        return Drop(
            reason=DropReason.DUPLICATE_PAIR,
            detail=f"same prompt, chosen and rejected as {first[0]} line {first[1]}",
            source=pair.source,
            line=pair.line,
        )


@dataclass
class DropLog:
    """Counts of dropped rows per reason, with the first few drops of each reason as examples."""

    counts: dict[DropReason, int] = field(default_factory=dict)
    examples: dict[DropReason, list[Drop]] = field(default_factory=dict)

    def add(self, drop: Drop) -> None:
        self.counts[drop.reason] = self.counts.get(drop.reason, 0) + 1
        reason_examples = self.examples.setdefault(drop.reason, [])
        if len(reason_examples) < EXAMPLES_PER_REASON:
            reason_examples.append(drop)

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def check_drop_fraction(kept: int, drops: DropLog, sources: Sequence[str], max_drop_fraction: float) -> None:
    """Raise DataValidationError when no pair is left or more than max_drop_fraction of rows were dropped.

    A high drop rate almost always means the wrong file or a format the parser misreads; training on the
    few rows that happened to parse would hide that, so the run stops and says what was dropped and why,
    with the first few rows of each reason (file, line, field), so the user can look at them at once.
    """
    total = kept + drops.total
    dropped_fraction = drops.total / total if total else 1.0
    if kept > 0 and dropped_fraction <= max_drop_fraction:
        return
    by_reason = ", ".join(f"{reason.value}={count}" for reason, count in sorted(drops.counts.items()))
    problem = (
        "no valid preference pairs remain"
        if kept == 0
        else (f"{dropped_fraction:.1%} of rows were dropped, more than max_drop_fraction={max_drop_fraction:.1%}")
    )
    examples = "; ".join(_first_drops(reason, drops.examples[reason]) for reason in sorted(drops.examples))
    raise DataValidationError(
        f"data validation failed for {', '.join(sources)}: {problem}; kept {kept}/{total} rows; "
        f"drops by reason: {by_reason or 'none'}" + (f"; first dropped rows: {examples}" if examples else "")
    )


def _first_drops(reason: DropReason, examples: Sequence[Drop]) -> str:
    """`reason: a.jsonl line 3 (missing field 'chosen'), ...` for the first few drops of one reason."""
    rows = ", ".join(f"{drop.source} line {drop.line} ({drop.detail})" for drop in examples[:EXAMPLES_IN_MESSAGE])
    return f"{reason.value}: {rows}"
