"""Parse one input row, in any of the common public preference formats, into a PreferencePair or a Drop.

Two formats cover the public preference datasets:

- HH transcript (Anthropic/hh-rlhf): `{"chosen": "...", "rejected": "..."}`, each side a whole dialogue
  whose turns start with "\\n\\nHuman: " or "\\n\\nAssistant: ". Both sides share every turn but the
  last Assistant turn, so the shared turns are the prompt and the two last turns are the replies.
- prompt/chosen/rejected (TRL, UltraFeedback, Dahoas and most newer sets): each field is a string or a
  list of `{"role", "content"}` messages. A reply given as a message list is its final assistant
  message; any messages before it must repeat the prompt. When `prompt` is absent and both replies are
  message lists (TRL's "implicit prompt" form), the shared messages before the replies are the prompt.
  A prompt string is one user message, unless it is itself an HH transcript ("Human: ..."), as in the
  Dahoas/*-hh-rlhf sets, in which case its turns are parsed and the trailing empty "Assistant:" cue is
  removed.

Every problem becomes a Drop with a reason and a detail naming the field and turn, never an exception:
one bad row out of 160k must not stop a run, and the report must say what was wrong with it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from enum import Enum

from rlhf_core.data.records import ROLES, Drop, DropReason, Message, PreferencePair, Role

# A turn marker at the very start of the text or after a blank line. The HH files always put "\n\n"
# before the first turn; derived copies often strip it, so the start of the text counts too.
_TURN_MARKER = re.compile(r"(?:^|\n\n)(Human|Assistant):")
_SPEAKER_ROLE: dict[str, Role] = {"Human": "user", "Assistant": "assistant"}


class PreferenceFormat(str, Enum):
    """The input formats detect_format can tell apart."""

    HH_TRANSCRIPT = "hh_transcript"
    PROMPT_CHOSEN_REJECTED = "prompt_chosen_rejected"


class _RowRejected(Exception):
    """Raised inside this module to stop parsing a row; parse_row turns it into a Drop."""

    def __init__(self, reason: DropReason, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


def detect_format(row: Mapping[str, object]) -> PreferenceFormat | None:
    """Choose the format from the row's keys; None when the row has none of the expected fields.

    A `prompt` key, or `chosen` given as a message list, means the prompt/chosen/rejected format;
    `chosen`/`rejected` without `prompt` as plain strings means HH transcripts.
    """
    if "prompt" in row or isinstance(row.get("chosen"), list):
        return PreferenceFormat.PROMPT_CHOSEN_REJECTED
    if "chosen" in row or "rejected" in row:
        return PreferenceFormat.HH_TRANSCRIPT
    return None


def parse_row(row: Mapping[str, object], source: str, line: int) -> PreferencePair | Drop:
    """Turn one decoded input row into a PreferencePair, or a Drop saying why it cannot be one."""
    row_format = detect_format(row)
    try:
        if row_format is PreferenceFormat.HH_TRANSCRIPT:
            prompt, chosen, rejected = _parse_hh_transcript(row)
        elif row_format is PreferenceFormat.PROMPT_CHOSEN_REJECTED:
            prompt, chosen, rejected = _parse_prompt_chosen_rejected(row)
        else:
            raise _RowRejected(
                DropReason.MISSING_FIELD, f"row has none of the fields prompt/chosen/rejected (keys: {sorted(row)})"
            )
    except _RowRejected as rejection:
        return Drop(reason=rejection.reason, detail=rejection.detail, source=source, line=line)
    return PreferencePair(prompt=prompt, chosen=chosen, rejected=rejected, source=source, line=line)


def _parse_transcript(text: str, field: str) -> list[Message]:
    """Split an HH transcript into messages ("Human" -> user, "Assistant" -> assistant), contents stripped.

    Raises _RowRejected(MALFORMED_TURNS) when there are no turns or there is text before the first turn.
    """
    parts = _TURN_MARKER.split(text)
    if len(parts) == 1:
        raise _RowRejected(DropReason.MALFORMED_TURNS, f"{field}: no 'Human:'/'Assistant:' turns found")
    if parts[0].strip():
        raise _RowRejected(DropReason.MALFORMED_TURNS, f"{field}: text before the first Human/Assistant turn")
    speakers, contents = parts[1::2], parts[2::2]
    return [
        Message(role=_SPEAKER_ROLE[speaker], content=content.strip()) for speaker, content in zip(speakers, contents)
    ]


def _check_prompt(prompt: Sequence[Message], field: str) -> None:
    """Check the turn structure every chat template accepts; raise _RowRejected(MALFORMED_TURNS) if not.

    Allowed: an optional system message first, then user and assistant turns alternating, starting and
    ending with a user turn (the policy writes the next assistant turn), and no empty turn.
    """
    turns = list(prompt[1:]) if prompt and prompt[0]["role"] == "system" else list(prompt)
    if not turns:
        raise _RowRejected(DropReason.MALFORMED_TURNS, f"{field}: the prompt has no user turn")
    for index, message in enumerate(prompt, start=1):
        if not message["content"]:
            raise _RowRejected(DropReason.MALFORMED_TURNS, f"{field}: turn {index} ({message['role']}) is empty")
    for index, message in enumerate(turns):
        expected = "user" if index % 2 == 0 else "assistant"
        if message["role"] != expected:
            raise _RowRejected(
                DropReason.MALFORMED_TURNS,
                f"{field}: expected a {expected} turn at prompt turn {index + 1}, found {message['role']} "
                "(turns must alternate user/assistant after an optional first system message)",
            )
    if turns[-1]["role"] != "user":
        raise _RowRejected(DropReason.MALFORMED_TURNS, f"{field}: the prompt does not end with a user turn")


def _split_reply(messages: Sequence[Message], field: str) -> tuple[tuple[Message, ...], str]:
    """Separate a conversation into (the turns before the reply, the final assistant reply)."""
    if not messages:
        raise _RowRejected(DropReason.MALFORMED_TURNS, f"{field}: no messages")
    last = messages[-1]
    if last["role"] != "assistant":
        raise _RowRejected(
            DropReason.MALFORMED_TURNS, f"{field}: the last turn is from the {last['role']}, not the assistant"
        )
    if not last["content"]:
        raise _RowRejected(DropReason.EMPTY_REPLY, f"{field}: the final assistant reply is empty")
    return tuple(messages[:-1]), last["content"]


def json_type(value: object) -> str:
    """The JSON name of a parsed value's type, as the file's author wrote it ("a number", not "a int")."""
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return "a list"
    return "null" if value is None else f"a {type(value).__name__}"


def _required(row: Mapping[str, object], field: str) -> object:
    value = row.get(field)
    if value is None:
        raise _RowRejected(DropReason.MISSING_FIELD, f"missing field '{field}'")
    return value


def _required_str(row: Mapping[str, object], field: str) -> str:
    value = _required(row, field)
    if not isinstance(value, str):
        raise _RowRejected(DropReason.WRONG_TYPE, f"field '{field}' is {json_type(value)}, expected a string")
    return value


def _check_replies_differ(chosen: str, rejected: str) -> None:
    if chosen == rejected:
        raise _RowRejected(DropReason.IDENTICAL_REPLIES, "chosen and rejected replies are identical")


def _parse_hh_transcript(row: Mapping[str, object]) -> tuple[tuple[Message, ...], str, str]:
    sides = {}
    for field in ("chosen", "rejected"):
        context, reply = _split_reply(_parse_transcript(_required_str(row, field), field), field)
        _check_prompt(context, field)
        sides[field] = (context, reply)
    (chosen_prompt, chosen), (rejected_prompt, rejected) = sides["chosen"], sides["rejected"]
    if chosen_prompt != rejected_prompt:
        raise _RowRejected(DropReason.PROMPT_MISMATCH, "chosen and rejected differ before their last Assistant turn")
    _check_replies_differ(chosen, rejected)
    return chosen_prompt, chosen, rejected


def _messages_from_list(value: list[object], field: str) -> list[Message]:
    """Check a list of chat messages and copy it with stripped contents."""
    messages = []
    for index, item in enumerate(value, start=1):
        if not isinstance(item, Mapping) or not isinstance(item.get("content"), str):
            raise _RowRejected(
                DropReason.MALFORMED_TURNS, f"{field}: message {index} is not a {{role, content: str}} object"
            )
        if item.get("role") not in ROLES:
            raise _RowRejected(
                DropReason.MALFORMED_TURNS,
                f"{field}: message {index} has role {item.get('role')!r}, expected one of {list(ROLES)}",
            )
        messages.append(Message(role=item["role"], content=item["content"].strip()))
    return messages


def _prompt_messages(value: object) -> tuple[Message, ...]:
    """The prompt field as messages: a message list, an HH transcript string, or one user message."""
    if isinstance(value, list):
        return tuple(_messages_from_list(value, "prompt"))
    if not isinstance(value, str):
        raise _RowRejected(
            DropReason.WRONG_TYPE, f"field 'prompt' is {json_type(value)}, expected a string or a list of messages"
        )
    if not value.startswith(("Human:", "\n\nHuman:")):
        return (Message(role="user", content=value.strip()),)
    messages = _parse_transcript(value, "prompt")
    if messages[-1] == Message(role="assistant", content=""):
        messages.pop()  # the "\n\nAssistant:" cue that asks for the reply
    return tuple(messages)


def _reply_field(row: Mapping[str, object], field: str) -> tuple[tuple[Message, ...], str]:
    """A reply field as (the messages before the reply, if given as a list; the reply text)."""
    value = _required(row, field)
    if isinstance(value, list):
        return _split_reply(_messages_from_list(value, field), field)
    if not isinstance(value, str):
        raise _RowRejected(
            DropReason.WRONG_TYPE, f"field '{field}' is {json_type(value)}, expected a string or a list of messages"
        )
    if not value.strip():
        raise _RowRejected(DropReason.EMPTY_REPLY, f"{field}: the reply is empty")
    return (), value.strip()


def _shared_prompt(
    explicit: tuple[Message, ...] | None, chosen_context: tuple[Message, ...], rejected_context: tuple[Message, ...]
) -> tuple[Message, ...]:
    """The one prompt both replies answer: the prompt field, or the messages both reply lists start with."""
    prompts = []
    for field, context in (("chosen", chosen_context), ("rejected", rejected_context)):
        if context and explicit is not None and context != explicit:
            raise _RowRejected(
                DropReason.PROMPT_MISMATCH, f"the messages before the {field} reply differ from 'prompt'"
            )
        prompt = context or explicit
        if prompt is None:
            raise _RowRejected(
                DropReason.MISSING_FIELD, f"missing field 'prompt' and '{field}' has no messages before its reply"
            )
        prompts.append(prompt)
    if prompts[0] != prompts[1]:
        raise _RowRejected(DropReason.PROMPT_MISMATCH, "chosen and rejected continue different conversations")
    return prompts[0]


def _parse_prompt_chosen_rejected(row: Mapping[str, object]) -> tuple[tuple[Message, ...], str, str]:
    explicit = _prompt_messages(_required(row, "prompt")) if "prompt" in row else None
    chosen_context, chosen = _reply_field(row, "chosen")
    rejected_context, rejected = _reply_field(row, "rejected")
    prompt = _shared_prompt(explicit, chosen_context, rejected_context)
    _check_prompt(prompt, "prompt")
    _check_replies_differ(chosen, rejected)
    return prompt, chosen, rejected
