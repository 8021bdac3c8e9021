"""What every judge works on and hands back: a pair of replies to one prompt, and a verdict on it.

Model A is the one under evaluation (e.g. the PPO policy) and model B the baseline (e.g. the SFT
model), so "A" is a win, "B" a loss. A judge that could not reach a verdict says "invalid": such
pairs are counted and reported, never guessed and never mixed into the rates.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Protocol

from rlhf_core.data.records import Message


class Verdict(str, Enum):
    """Which reply a judge prefers."""

    A = "A"
    B = "B"
    TIE = "tie"
    INVALID = "invalid"

    @property
    def outcome(self) -> int:
        """+1 for a win of model A, -1 for a loss, 0 for a tie (win minus loss is their mean)."""
        if self is Verdict.INVALID:
            raise ValueError("an invalid verdict has no outcome; leave it out of the rates")
        return {Verdict.A: 1, Verdict.B: -1, Verdict.TIE: 0}[self]


@dataclass(frozen=True)
class EvalPair:
    """One prompt of the evaluation split with model A's and model B's reply to it."""

    prompt_id: str
    prompt: tuple[Message, ...]
    reply_a: str
    reply_b: str
    category: str

    @property
    def pair_key(self) -> str:
        """sha256 of (prompt id, reply A, reply B): matches verdicts of different judges on the same pair."""
        return hashlib.sha256(json.dumps([self.prompt_id, self.reply_a, self.reply_b]).encode()).hexdigest()


@dataclass(frozen=True)
class Judgement:
    """A judge's verdict on one pair and what it was based on (scores, raw answers), for verdicts.jsonl."""

    verdict: Verdict
    detail: dict[str, Any] = field(default_factory=dict)

    @property
    def score_diff(self) -> float | None:
        """The judge's score of A's reply minus B's (`score_a`, `score_b` of the detail: the reward-model
        judge); None for a judge that gives verdicts without scores."""
        if "score_a" not in self.detail or "score_b" not in self.detail:
            return None
        return float(self.detail["score_a"]) - float(self.detail["score_b"])

    @property
    def score_b(self) -> float | None:
        """The judge's score of B's reply (`score_b` of the detail); None for a judge without scores."""
        return float(self.detail["score_b"]) if "score_b" in self.detail else None


@dataclass(frozen=True)
class JudgeInfo:
    """Who judged, for the report: kind ("rm", "llm" or "human"), a short name (chart titles,
    verdicts.jsonl, agreement tables), the role (which judge this was, e.g. "the independent judge reward
    model": the one wording report.md and the run summary both use), a one-line description, and usage
    figures.

    `in_sample` is True when the judge is the reward model PPO optimised against: the policy was trained
    to please exactly this judge, so its verdicts overstate the policy's real quality.
    """

    kind: str
    name: str
    role: str
    description: str
    in_sample: bool = False
    figures: dict[str, float] = field(default_factory=dict)


class Judge(Protocol):
    """Anything that gives one verdict per pair, in the order of the pairs."""

    def judge(self, pairs: Sequence[EvalPair]) -> list[Judgement]: ...

    def info(self) -> JudgeInfo:
        """Description and figures (e.g. token usage) of the judging done so far."""
        ...
