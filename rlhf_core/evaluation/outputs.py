"""The per-pair files of an evaluation: generations.jsonl (what was judged) and verdicts.jsonl (the verdicts),
and the same two for the length-matched pairs (length_matching.py).

generations.jsonl, one line per evaluation prompt:
    prompt_id, category, prompt (list of {role, content}), reply_a, reply_b, tokens_a, tokens_b,
    finished_a, finished_b (False: the reply was cut at max_new_tokens)
verdicts.jsonl, one line per pair, in the same order:
    prompt_id, pair_key, category, judge (its short name), verdict ("A", "B", "tie", "invalid"),
    tokens_a, tokens_b, and the judge's detail (reward-model scores, or the LLM's verdict in each order
    and its raw answers)
generations_matched.jsonl / verdicts_matched.jsonl: the same lines for the length-matched pairs (one per
    prompt that has one), generations with `sample_a` and `sample_b` added: which of each model's replies
    to the prompt (0: the main reply of generations.jsonl)
generations_samples.jsonl / verdicts_samples.jsonl: the same lines for the further same-index pairs the
    length-controlled win rate is fitted on (A's i-th reply against B's i-th, i >= 1; the main pair is
    i = 0), generations with `sample` added: i
generations_anchors.jsonl / verdicts_anchors.jsonl: the anchor pairs of the length-controlled win rate,
    model B's replies to a prompt against each other (reply_a: B's i-th, reply_b: B's (i+1)-th, for every
    i of its drawn replies), generations with `sample_a` and `sample_b` added: i and i + 1

Any later judge (the human-evaluation flow) reads the pairs back with `read_generations`, so every
judge sees the same pairs; `read_verdicts` gives another judge's verdicts by pair key, for agreement.
Files are written whole to a temporary file and moved into place (`write_text`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlhf_core.atomic import atomic_write_text
from rlhf_core.evaluation.generation import Reply
from rlhf_core.evaluation.judges.verdicts import EvalPair, Judgement, Verdict
from rlhf_core.evaluation.length_matching import MatchedPair
from rlhf_core.evaluation.prompts import EvalPrompt

# The file names, in an evaluation's output directory (and a human-evaluation session's, which copies them).
GENERATIONS_FILE = "generations.jsonl"
VERDICTS_FILE = "verdicts.jsonl"
MATCHED_GENERATIONS_FILE = "generations_matched.jsonl"
MATCHED_VERDICTS_FILE = "verdicts_matched.jsonl"
SAMPLE_GENERATIONS_FILE = "generations_samples.jsonl"
SAMPLE_VERDICTS_FILE = "verdicts_samples.jsonl"
ANCHOR_GENERATIONS_FILE = "generations_anchors.jsonl"
ANCHOR_VERDICTS_FILE = "verdicts_anchors.jsonl"


@dataclass(frozen=True)
class GeneratedPair:
    """A pair to judge and the token counts of its two replies."""

    pair: EvalPair
    tokens_a: int
    tokens_b: int


def write_jsonl(path: Path, rows: Iterable[dict[str, Any]]) -> Path:
    """Write `rows` as JSON lines to `path` atomically."""
    return atomic_write_text(path, "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The rows of a JSON-lines file."""
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found")
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def generation_rows(
    prompts: Sequence[EvalPrompt], replies_a: Sequence[Reply], replies_b: Sequence[Reply]
) -> list[dict[str, Any]]:
    """The lines of generations.jsonl."""
    if not len(prompts) == len(replies_a) == len(replies_b):
        raise ValueError(f"{len(prompts)} prompts but {len(replies_a)} and {len(replies_b)} replies")
    return [
        {
            "prompt_id": prompt.prompt_id,
            "category": prompt.category,
            "prompt": [dict(message) for message in prompt.prompt],
            "reply_a": a.text,
            "reply_b": b.text,
            "tokens_a": a.tokens,
            "tokens_b": b.tokens,
            "finished_a": a.finished,
            "finished_b": b.finished,
        }
        for prompt, a, b in zip(prompts, replies_a, replies_b)
    ]


def matched_generation_rows(matched: Sequence[MatchedPair]) -> list[dict[str, Any]]:
    """The lines of generations_matched.jsonl."""
    rows = generation_rows(
        [pair.prompt for pair in matched], [pair.reply_a for pair in matched], [pair.reply_b for pair in matched]
    )
    return [{**row, "sample_a": pair.sample_a, "sample_b": pair.sample_b} for row, pair in zip(rows, matched)]


def sample_generation_rows(
    prompts: Sequence[EvalPrompt],
    samples_a: Sequence[Sequence[Reply]],
    samples_b: Sequence[Sequence[Reply]],
    pairs_per_prompt: int,
) -> list[dict[str, Any]]:
    """The lines of generations_samples.jsonl: for each prompt, A's i-th reply against B's i-th for
    i = 1 .. pairs_per_prompt - 1 (samples_x[p]: model x's replies to prompt p, the main one first)."""
    rows = []
    for prompt, replies_a, replies_b in zip(prompts, samples_a, samples_b):
        if min(len(replies_a), len(replies_b)) < pairs_per_prompt:
            raise ValueError(f"prompt {prompt.prompt_id}: fewer than {pairs_per_prompt} replies of each model")
        for sample in range(1, pairs_per_prompt):
            (row,) = generation_rows([prompt], [replies_a[sample]], [replies_b[sample]])
            rows.append({**row, "sample": sample})
    return rows


def anchor_generation_rows(prompts: Sequence[EvalPrompt], samples_b: Sequence[Sequence[Reply]]) -> list[dict[str, Any]]:
    """The lines of generations_anchors.jsonl: for each prompt, model B's i-th reply against its (i+1)-th
    (samples_b[p]: B's replies to prompt p, the main one first); none for a prompt with one reply."""
    rows = []
    for prompt, replies in zip(prompts, samples_b, strict=True):
        for sample in range(len(replies) - 1):
            (row,) = generation_rows([prompt], [replies[sample]], [replies[sample + 1]])
            rows.append({**row, "sample_a": sample, "sample_b": sample + 1})
    return rows


def read_generations(path: Path) -> list[GeneratedPair]:
    """The pairs of a generations.jsonl, in file order."""
    return [
        GeneratedPair(
            pair=EvalPair(
                prompt_id=row["prompt_id"],
                prompt=tuple(row["prompt"]),
                reply_a=row["reply_a"],
                reply_b=row["reply_b"],
                category=row["category"],
            ),
            tokens_a=int(row["tokens_a"]),
            tokens_b=int(row["tokens_b"]),
        )
        for row in read_jsonl(path)
    ]


def verdict_rows(
    pairs: Sequence[GeneratedPair], judgements: Sequence[Judgement], judge_name: str
) -> list[dict[str, Any]]:
    """The lines of verdicts.jsonl."""
    if len(pairs) != len(judgements):
        raise ValueError(f"{len(pairs)} pairs but {len(judgements)} verdicts")
    return [
        {
            "prompt_id": generated.pair.prompt_id,
            "pair_key": generated.pair.pair_key,
            "category": generated.pair.category,
            "judge": judge_name,
            "verdict": judgement.verdict.value,
            "tokens_a": generated.tokens_a,
            "tokens_b": generated.tokens_b,
            **judgement.detail,
        }
        for generated, judgement in zip(pairs, judgements)
    ]


def read_verdicts(path: Path) -> tuple[str, dict[str, Verdict]]:
    """(judge name, verdict by pair key) of a verdicts.jsonl."""
    rows = read_jsonl(path)
    if not rows:
        raise ValueError(f"{path} holds no verdicts")
    names = {row["judge"] for row in rows}
    if len(names) != 1:
        raise ValueError(f"{path} mixes verdicts of several judges: {sorted(names)}")
    return names.pop(), {row["pair_key"]: Verdict(row["verdict"]) for row in rows}
