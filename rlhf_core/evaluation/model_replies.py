"""One model's replies to the evaluation prompts, and a store that keeps them by what decides them.

An evaluation samples both of its models. The baseline is most often the same SFT model every time: each
variant of an ablation, each retraining and each promotion evaluates a new policy against it. The replies
of a model are decided by its weights, the prompts, the sampling settings and seed, the batch they are
sampled in and the hardware (and the thread count: it can change the order of a matmul's sums), so
`ReplyStore` keeps them under a key of exactly those (`replies_key`), and an evaluation that meets the same
model again reads its replies instead of sampling them anew (half of an evaluation's time on a CPU;
docs/stage-bounds.md). Same key, same replies: a stored entry is what
sampling would give on this hardware and torch version, which the key holds.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from rlhf_core.atomic import atomic_write_text
from rlhf_core.config import Config
from rlhf_core.evaluation.generation import Reply
from rlhf_core.evaluation.prompts import EvalPrompt

STORE_FORMAT = 1  # bump when the stored entry or the way replies are drawn changes


@dataclass(frozen=True)
class ModelReplies:
    """One model's replies: the main reply to each prompt, `extra[p]` the further replies to prompt p for
    the length-matched pairs, and its perplexity on the held-out reference replies (and their count)."""

    main: list[Reply]
    extra: list[list[Reply]]
    perplexity: float
    measured: int

    def samples(self) -> list[list[Reply]]:
        """Every reply to each prompt, the main one first."""
        return [[main, *extra] for main, extra in zip(self.main, self.extra)]


def replies_key(model_sha256: str, prompts: Sequence[EvalPrompt], config: Config, device: torch.device) -> str:
    """A sha256 of everything that decides a model's `ModelReplies`: the model's content, the prompts and
    their reference replies, the sampling settings, seed and sample count, the batch size, the settings of
    the perplexity measurement, the dtype and precision, the device type, the CPU threads and torch version."""
    evaluation = config.evaluation
    identity = {
        "format": STORE_FORMAT,
        "model": model_sha256,
        "prompts": [[prompt.prompt_id, prompt.prompt, prompt.reference_reply] for prompt in prompts],
        "generation": evaluation.generation.model_dump(mode="json"),
        "samples": evaluation.length_matched_samples,
        "seed": config.seed,
        "batch_size": evaluation.batch_size,
        "perplexity": [config.sft.max_length, config.sft.micro_batch_size],
        "dtype": config.model.dtype,
        "bf16": config.distributed.uses_bf16,
        "device": device.type,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()


class ReplyStore:
    """`ModelReplies` as one JSON file per key in a directory (written whole, atomically)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def path(self, key: str) -> Path:
        return self.root / f"{key}.json"

    def load(self, key: str) -> ModelReplies | None:
        """The replies stored under `key`; None when there are none (or the file cannot be read as them,
        which the next `save` replaces)."""
        try:
            stored = json.loads(self.path(key).read_text(encoding="utf-8"))
            return ModelReplies(
                main=[Reply(**reply) for reply in stored["main"]],
                extra=[[Reply(**reply) for reply in replies] for replies in stored["extra"]],
                perplexity=float(stored["perplexity"]),
                measured=int(stored["measured"]),
            )
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def save(self, key: str, replies: ModelReplies) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.path(key), json.dumps(asdict(replies)) + "\n")
