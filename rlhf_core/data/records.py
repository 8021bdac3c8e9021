"""The records the data stage produces: chat messages, preference pairs, SFT examples, PPO prompts, drops.

Every later stage (reward model, SFT, PPO, evaluation) reads these shapes back from parquet, so they are
kept deliberately small: a prompt is a list of chat messages ending with a user turn, and a reply is the
plain text of one assistant message.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from enum import Enum
from functools import cached_property
from typing import Literal, TypedDict

Role = Literal["system", "user", "assistant"]
ROLES: tuple[Role, ...] = ("system", "user", "assistant")


class Message(TypedDict):
    """One chat turn, in the shape every Hugging Face chat template accepts."""

    role: Role
    content: str


def _sha256_hex(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def normalise_prompt_text(prompt: tuple[Message, ...]) -> str:
    """The prompt as one canonical string, used only for identity (hashing), never for training.

    - Roles are kept: the same words said by the system or by the user are a different conversation.
    - Whitespace runs collapse to one space: scraped and transcribed data differ in spaces, tabs and
      line breaks that do not change the question, and such near-copies must land in the same split so
      an evaluation prompt can never leak into training through a reformatted copy.
    - Leading/trailing whitespace is stripped for the same reason (it is formatting, not content).
    - Text is case-folded (the Unicode-aware form of lower-casing) because "How do I ..." and
      "how do i ..." are the same prompt for leakage purposes.
    After collapsing, no content contains a newline, so joining messages with newlines is unambiguous.
    """
    return "\n".join(f"{message['role']}: {' '.join(message['content'].split()).casefold()}" for message in prompt)


@dataclass(frozen=True)
class PreferencePair:
    """One human judgement: for `prompt`, the reply `chosen` was preferred over `rejected`.

    `source` is the file (or Hub dataset) the pair came from and `line` its 1-based line number in a
    .jsonl file, or its 1-based record number in a .json list, parquet file or Hub split; together they
    let a user find the original row from any report or output file.
    """

    prompt: tuple[Message, ...]
    chosen: str
    rejected: str
    source: str
    line: int

    # cached_property stores into the instance __dict__ directly, which a frozen dataclass allows; the
    # ids are asked for several times per pair (dedupe, split, write) and each costs a sha256.
    @cached_property
    def prompt_id(self) -> str:
        """sha256 of the normalised prompt: the unit of splitting, so one prompt never spans two splits."""
        return _sha256_hex(normalise_prompt_text(self.prompt))

    @cached_property
    def pair_id(self) -> str:
        """sha256 of (prompt_id, chosen, rejected): identical judgements share it, which finds duplicates."""
        return _sha256_hex(json.dumps([self.prompt_id, self.chosen, self.rejected]))


@dataclass(frozen=True)
class SftExample:
    """A prompt and a reply to imitate (the chosen reply of a reward-model training pair)."""

    prompt_id: str
    prompt: tuple[Message, ...]
    response: str


@dataclass(frozen=True)
class PpoPrompt:
    """A prompt the policy answers during PPO; its reply is scored by the reward model."""

    prompt_id: str
    prompt: tuple[Message, ...]


class DropReason(str, Enum):
    """Why an input row did not become a preference pair; the data report counts rows per reason."""

    MALFORMED_JSON = "malformed_json"
    MISSING_FIELD = "missing_field"
    WRONG_TYPE = "wrong_type"
    EMPTY_REPLY = "empty_reply"
    IDENTICAL_REPLIES = "identical_replies"
    PROMPT_MISMATCH = "prompt_mismatch"
    MALFORMED_TURNS = "malformed_turns"
    TOO_LONG = "too_long"
    DUPLICATE_PAIR = "duplicate_pair"


@dataclass(frozen=True)
class Drop:
    """A row that was left out, where it was, and a human-readable detail saying what exactly was wrong."""

    reason: DropReason
    detail: str
    source: str
    line: int
