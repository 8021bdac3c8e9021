"""The prompts of a throughput run, identical for this project's trainer and TRL's.

Every prompt is exactly `length` tokens, so no run pays for padding and both implementations see
the same token ids. A prompt is a dialogue rendered through the tokenizer's chat template with the
generation prompt and cut from the LEFT to its last `length` tokens: exactly what
`rlhf_core.models.chat.encode_prompt` does inside the PPO trainer (`encode_prompt_ids` repeats it
here because the TRL side runs in another environment, without rlhf_core; a test checks that the
two agree).

Two sources:
- a file of HH-RLHF preference pairs (`{"chosen": "...", ...}` transcripts, `.jsonl` or
  `.jsonl.gz`; by default the shared `pairs-1800.jsonl.gz`, read in place): every turn of the
  chosen transcript but its last assistant reply becomes the prompt, that reply the PPO-ptx
  example; dialogues shorter than `length` tokens are skipped;
- "synthetic": a user turn of random words from the tokenizer's vocabulary, drawn from `seed`.

Needs only the standard library and a Hugging Face tokenizer.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_PAIRS = REPO_ROOT.parent / "shared" / "data" / "hh-rlhf-harmless" / "pairs-1800.jsonl.gz"
SYNTHETIC = "synthetic"
TURN_MARKER = re.compile(r"\n\n(Human|Assistant): ")
ROLES = {"Human": "user", "Assistant": "assistant"}

Messages = list[dict[str, str]]


@dataclass(frozen=True)
class Prompt:
    """One benchmark prompt: the dialogue, and a reply to it (the PPO-ptx example, if PPO-ptx is on)."""

    messages: Messages
    reply: str


def encode_prompt_ids(tokenizer: Any, messages: Messages, length: int) -> list[int]:
    """Chat template + generation prompt, tokenized without added special tokens, last `length` ids.

    The same steps as `rlhf_core.models.chat.encode_prompt(tokenizer, messages, length)`.
    """
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return ids[max(0, len(ids) - length) :]


def fingerprint(prompt_ids: list[list[int]]) -> str:
    """A short hash of the prompts' token ids: equal on both sides iff they ran the same prompts."""
    return hashlib.sha256(json.dumps(prompt_ids).encode()).hexdigest()[:16]


def hh_dialogue(transcript: str) -> Prompt | None:
    """An HH-RLHF transcript -> the prompt (every turn before the last reply) and that reply.

    None for a transcript that does not alternate Human/Assistant turns and end with an assistant reply.
    """
    parts = TURN_MARKER.split(transcript)
    if parts[0].strip() or len(parts) < 5:  # text before the first turn, or fewer than two turns
        return None
    turns = [(ROLES[parts[i]], parts[i + 1].strip()) for i in range(1, len(parts), 2)]
    roles = [role for role, _ in turns]
    if roles != ["user", "assistant"] * (len(turns) // 2) or not all(text for _, text in turns):
        return None
    messages = [{"role": role, "content": text} for role, text in turns[:-1]]
    return Prompt(messages=messages, reply=turns[-1][1])


def _read_rows(path: Path) -> Iterator[dict[str, Any]]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as lines:
        for line in lines:
            if line.strip():
                yield json.loads(line)


def data_prompts(tokenizer: Any, path: Path, count: int, length: int) -> list[Prompt]:
    """The first `count` dialogues of the file (in file order) with at least `length` prompt tokens."""
    if not path.is_file():
        raise FileNotFoundError(f"prompt data {path} not found (or pass --data {SYNTHETIC})")
    prompts = []
    for row in _read_rows(path):
        prompt = hh_dialogue(str(row.get("chosen", "")))
        if prompt is None:
            continue
        text = tokenizer.apply_chat_template(prompt.messages, tokenize=False, add_generation_prompt=True)
        if len(tokenizer(text, add_special_tokens=False)["input_ids"]) >= length:
            prompts.append(prompt)
            if len(prompts) == count:
                return prompts
    raise ValueError(
        f"{path} has only {len(prompts)} dialogues with at least {length} prompt tokens, {count} needed: "
        f"use a shorter --prompt-length or --data {SYNTHETIC}"
    )


def _vocabulary_words(tokenizer: Any) -> list[str]:
    """Whole lower-case words of the vocabulary (byte-level BPE tokens 'Ġword')."""
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    return sorted({token[1:] for token in tokens if re.fullmatch(r"Ġ[a-z]{3,}", token)})


def synthetic_prompts(tokenizer: Any, count: int, length: int, seed: int) -> list[Prompt]:
    """`count` user turns of random vocabulary words, long enough to fill `length` tokens."""
    words = _vocabulary_words(tokenizer)
    if not words:
        raise ValueError("the tokenizer has no 'Ġword' tokens to draw synthetic prompts from")
    generator = random.Random(seed)
    return [
        Prompt(
            messages=[{"role": "user", "content": " ".join(generator.choices(words, k=length))}],
            reply=" ".join(generator.choices(words, k=16)),
        )
        for _ in range(count)
    ]


def benchmark_prompts(tokenizer: Any, source: str, count: int, length: int, seed: int) -> list[Prompt]:
    """`count` prompts of at least `length` tokens from `source` (a pairs file or "synthetic")."""
    if source == SYNTHETIC:
        return synthetic_prompts(tokenizer, count, length, seed)
    return data_prompts(tokenizer, Path(source), count, length)
