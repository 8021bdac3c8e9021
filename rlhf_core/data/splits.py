"""Deterministic, leak-free splits: each prompt goes to one split chosen by a salted hash of its prompt_id.

The hash of (salt, prompt_id) is read as a number in [0, 1) and cut into consecutive ranges:

    [0, eval)              eval      held-out prompts and pairs for final evaluation
    [.., + rm_val)         rm_val    reward-model validation pairs
    [.., + ppo)            ppo       prompts the policy answers during PPO (their pairs train the
                                     independent judge reward model); the first `ppo_val` of this
                                     range holds the prompts PPO validates on and never trains on
    [.., 1)                rm_train  reward-model training pairs (and SFT examples)

Because the split depends only on the prompt and the salt, every pair of one prompt lands in the same
split (no prompt leaks from training into evaluation), the result does not depend on input order, and
a prompt keeps its split when more data is added later. Caps keep the items with the lowest hash values,
which is also independent of input order; what a cap leaves out is left out, never moved to another
split, since moving it would break the two guarantees above.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import TypeVar

from rlhf_core.data.records import PpoPrompt, PreferencePair, SftExample

T = TypeVar("T")


class Split(str, Enum):
    """The four hash buckets a prompt can fall into."""

    EVAL = "eval"
    RM_VAL = "rm_val"
    PPO = "ppo"
    RM_TRAIN = "rm_train"


@dataclass(frozen=True)
class SplitConfig:
    """Bucket fractions (rm_train gets the rest), the salt, and optional caps (None = no cap)."""

    eval_fraction: float
    rm_val_fraction: float
    ppo_fraction: float
    salt: str
    ppo_val_fraction: float = 0.0
    max_eval_pairs: int | None = None
    max_rm_val_pairs: int | None = None
    max_rm_train_pairs: int | None = None
    max_ppo_prompts: int | None = None
    max_sft_examples: int | None = None

    def __post_init__(self) -> None:
        fractions = {
            "eval_fraction": self.eval_fraction,
            "rm_val_fraction": self.rm_val_fraction,
            "ppo_fraction": self.ppo_fraction,
        }
        for name, value in fractions.items():
            if not 0.0 <= value < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {value}")
        if not 0.0 <= self.ppo_val_fraction < self.ppo_fraction:
            raise ValueError(
                f"ppo_val_fraction must be in [0, ppo_fraction={self.ppo_fraction:g}): it is a slice of the PPO "
                f"prompts, got {self.ppo_val_fraction}"
            )
        total = sum(fractions.values())
        if total >= 1.0:
            raise ValueError(
                f"eval_fraction + rm_val_fraction + ppo_fraction = {total:g} must be < 1: "
                "rm_train gets the rest and would be empty"
            )
        caps = {
            "max_eval_pairs": self.max_eval_pairs,
            "max_rm_val_pairs": self.max_rm_val_pairs,
            "max_rm_train_pairs": self.max_rm_train_pairs,
            "max_ppo_prompts": self.max_ppo_prompts,
            "max_sft_examples": self.max_sft_examples,
        }
        for name, cap in caps.items():
            if cap is not None and cap < 0:
                raise ValueError(f"{name} must be >= 0 or None, got {cap}")


@dataclass(frozen=True)
class Splits:
    """The prepared datasets, in input order, and how many items each cap left out."""

    rm_train: list[PreferencePair]
    rm_val: list[PreferencePair]
    eval: list[PreferencePair]
    sft: list[SftExample]
    ppo_prompts: list[PpoPrompt]
    ppo_val_prompts: list[PpoPrompt]
    ppo_pairs: list[PreferencePair]
    held_back_by_caps: dict[str, int]


def prompt_bucket(prompt_id: str, salt: str) -> float:
    """The prompt's position in [0, 1): the first 8 bytes of sha256(salt, prompt_id) over 2**64.

    Changing the salt reshuffles every prompt; keep it fixed for a project so splits stay put.
    """
    digest = hashlib.sha256(f"{salt}\n{prompt_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def assign_split(prompt_id: str, config: SplitConfig) -> Split:
    """The split of one prompt, from its bucket and the configured fractions."""
    bucket = prompt_bucket(prompt_id, config.salt)
    boundaries = (
        (Split.EVAL, config.eval_fraction),
        (Split.RM_VAL, config.rm_val_fraction),
        (Split.PPO, config.ppo_fraction),
    )
    upper = 0.0
    for split, fraction in boundaries:
        upper += fraction
        if bucket < upper:
            return split
    return Split.RM_TRAIN


def split_pairs(pairs: Sequence[PreferencePair], config: SplitConfig) -> Splits:
    """Assign pairs to splits, apply the caps, and derive the SFT examples and PPO prompts.

    SFT examples are the chosen replies of the (capped) rm_train pairs, one per distinct prompt+reply,
    so supervised fine-tuning never sees an eval, rm_val or PPO prompt. PPO prompts are the distinct
    prompts of the ppo bucket, less the validation slice (`ppo_val_prompts`: the prompts whose hash lies
    in the first `ppo_val_fraction` of the bucket), which PPO chooses its output policy on and never
    trains on; the final evaluation's `eval` prompts so stay unseen by every choice. The ppo bucket's pairs (all of
    them: `max_ppo_prompts` caps the prompts
    PPO answers, not this list) train only the independent judge reward model, which is so disjoint
    from the policy reward model's rm_train pairs, from rm_val and from eval.
    """
    buckets = {pair.prompt_id: prompt_bucket(pair.prompt_id, config.salt) for pair in pairs}
    by_split: dict[Split, list[PreferencePair]] = {split: [] for split in Split}
    for pair in pairs:
        by_split[assign_split(pair.prompt_id, config)].append(pair)

    def pair_rank(pair: PreferencePair) -> tuple[float, str]:
        return buckets[pair.prompt_id], pair.pair_id

    rm_train = _keep_lowest(by_split[Split.RM_TRAIN], pair_rank, config.max_rm_train_pairs)
    rm_val = _keep_lowest(by_split[Split.RM_VAL], pair_rank, config.max_rm_val_pairs)
    eval_pairs = _keep_lowest(by_split[Split.EVAL], pair_rank, config.max_eval_pairs)

    sft_candidates = _sft_examples(rm_train)
    sft = _keep_lowest(
        sft_candidates,
        lambda example: (buckets[example.prompt_id], _sha256_json([example.prompt_id, example.response])),
        config.max_sft_examples,
    )
    validation_end = config.eval_fraction + config.rm_val_fraction + config.ppo_val_fraction
    ppo_val_prompts = [
        prompt for prompt in _distinct_prompts(by_split[Split.PPO]) if buckets[prompt.prompt_id] < validation_end
    ]
    ppo_candidates = [
        prompt for prompt in _distinct_prompts(by_split[Split.PPO]) if buckets[prompt.prompt_id] >= validation_end
    ]
    ppo_prompts = _keep_lowest(
        ppo_candidates, lambda prompt: (buckets[prompt.prompt_id], prompt.prompt_id), config.max_ppo_prompts
    )
    held_back = {
        "rm_train": len(by_split[Split.RM_TRAIN]) - len(rm_train),
        "rm_val": len(by_split[Split.RM_VAL]) - len(rm_val),
        "eval": len(by_split[Split.EVAL]) - len(eval_pairs),
        "sft": len(sft_candidates) - len(sft),
        "ppo_prompts": len(ppo_candidates) - len(ppo_prompts),
    }
    return Splits(
        rm_train=rm_train,
        rm_val=rm_val,
        eval=eval_pairs,
        sft=sft,
        ppo_prompts=ppo_prompts,
        ppo_val_prompts=ppo_val_prompts,
        ppo_pairs=by_split[Split.PPO],
        held_back_by_caps=held_back,
    )


def _keep_lowest(items: list[T], rank: Callable[[T], tuple[float, str]], limit: int | None) -> list[T]:
    """The `limit` items of lowest rank (all when limit is None), kept in their input order."""
    if limit is None or len(items) <= limit:
        return items
    kept = sorted(sorted(range(len(items)), key=lambda index: rank(items[index]))[:limit])
    return [items[index] for index in kept]


def _sha256_json(value: object) -> str:
    return hashlib.sha256(json.dumps(value).encode("utf-8")).hexdigest()


def _sft_examples(pairs: Sequence[PreferencePair]) -> list[SftExample]:
    """One example per distinct (prompt, chosen reply), in first-seen order."""
    examples: dict[tuple[str, str], SftExample] = {}
    for pair in pairs:
        examples.setdefault(
            (pair.prompt_id, pair.chosen),
            SftExample(prompt_id=pair.prompt_id, prompt=pair.prompt, response=pair.chosen),
        )
    return list(examples.values())


def _distinct_prompts(pairs: Sequence[PreferencePair]) -> list[PpoPrompt]:
    """One PPO prompt per distinct prompt_id, in first-seen order."""
    prompts: dict[str, PpoPrompt] = {}
    for pair in pairs:
        prompts.setdefault(pair.prompt_id, PpoPrompt(prompt_id=pair.prompt_id, prompt=pair.prompt))
    return list(prompts.values())
