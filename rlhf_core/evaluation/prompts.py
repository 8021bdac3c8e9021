"""The fixed evaluation prompts: distinct prompts of the prepared `eval` split, ordered by prompt id.

The split is assigned by prompt hash (rlhf_core.data.splits), so these prompts never reached SFT,
reward-model training or PPO. Taking the `max_prompts` prompts with the smallest ids (sha256 of the
normalised prompt) gives a sample that is random with respect to content and source file, does not
depend on the order of the input files, and changes little when data is added: a new prompt enters
only if its id sorts among the first. Every model is asked the same prompts, every judge sees the
same pairs.

Each prompt keeps, from the first preference pair it appears in, its chosen reply (a held-out SFT
reply: the alignment tax is measured on these) and a category: the name of the file the pair came
from, without its suffixes (e.g. "harmless-base" and "helpful-base" for HH-RLHF files), so a report
can break results down the way the paper's Figure 10 does.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rlhf_core.data.prepare import load_split
from rlhf_core.data.records import Message

SOURCE_SUFFIXES = (".jsonl.gz", ".jsonl", ".json", ".parquet")


@dataclass(frozen=True)
class EvalPrompt:
    """One evaluation prompt, its held-out reference reply and its category."""

    prompt_id: str
    prompt: tuple[Message, ...]
    reference_reply: str
    category: str


def category_of(source: str) -> str:
    """The category of a pair's source: a file name without its data suffix, a Hub id as it is."""
    for suffix in SOURCE_SUFFIXES:
        if source.endswith(suffix):
            return source[: -len(suffix)]
    return source


def evaluation_prompts(data_dir: str | Path, max_prompts: int | None) -> list[EvalPrompt]:
    """The `max_prompts` distinct prompts with the smallest ids in the `eval` split (None: all of them)."""
    if max_prompts is not None and max_prompts < 1:
        raise ValueError(f"max_prompts must be >= 1, got {max_prompts}")
    prompts: dict[str, EvalPrompt] = {}
    for pair in load_split(Path(data_dir), "eval"):
        if pair.prompt_id not in prompts:
            prompts[pair.prompt_id] = EvalPrompt(
                prompt_id=pair.prompt_id,
                prompt=pair.prompt,
                reference_reply=pair.chosen,
                category=category_of(pair.source),
            )
    if not prompts:
        raise ValueError(f"{data_dir}: the eval split is empty; prepare more data or raise data.eval_fraction")
    return [prompts[prompt_id] for prompt_id in sorted(prompts)[:max_prompts]]
