"""training_data.json: which prepared data trained and selected a reward model, and what it started from.

The train-rm and judge-rm stages write it next to model/ (not inside it: the model directory's content
hash, which pins downstream caches and the in-sample check, stays that of the weights alone). The
reward-model judge reads it, so an evaluation report can say what judged: the policy's reward model
(trained on rm_train) or the independent judge (trained on the PPO-prompt split's pairs).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict

from rlhf_core.atomic import atomic_write_text

TRAINING_DATA_FILE = "training_data.json"
TrainSplit = Literal["rm_train", "ppo_pairs"]
# How a report names each training split.
SPLIT_NAMES: dict[str, str] = {"rm_train": "the reward-model training split", "ppo_pairs": "the PPO-prompt split"}
INIT_NAMES: dict[str, str] = {"sft": "the SFT model", "base": "the base model"}


class RewardTrainingData(BaseModel):
    """The splits (prepared-data file stems) a reward model was trained and validated on, the sha256 of
    its training file, and the model it was initialised from (`reward.init_from`)."""

    model_config = ConfigDict(frozen=True)

    train_split: TrainSplit
    train_file_sha256: str
    validation_split: Literal["rm_val"]
    init_from: Literal["sft", "base"]

    def describe(self) -> str:
        """E.g. 'trained on the PPO-prompt split, validated on rm_val, initialised from the base model'."""
        return (
            f"trained on {SPLIT_NAMES[self.train_split]}, validated on {self.validation_split}, "
            f"initialised from {INIT_NAMES[self.init_from]}"
        )


def training_data_record(
    data_dir: Path, train_split: TrainSplit, init_from: Literal["sft", "base"]
) -> RewardTrainingData:
    """The record of a reward model trained on `data_dir/<train_split>.parquet` and validated on rm_val."""
    train_file = Path(data_dir) / f"{train_split}.parquet"
    return RewardTrainingData(
        train_split=train_split,
        train_file_sha256=hashlib.sha256(train_file.read_bytes()).hexdigest(),
        validation_split="rm_val",
        init_from=init_from,
    )


def write_training_data(out_dir: Path, record: RewardTrainingData) -> None:
    """Write `out_dir/training_data.json` atomically."""
    atomic_write_text(Path(out_dir) / TRAINING_DATA_FILE, record.model_dump_json(indent=2) + "\n")


def read_training_data(rm_dir: Path) -> RewardTrainingData | None:
    """The record of a reward-model stage output directory; None for a bare model directory (or a registry
    download, or an output written before the record existed), which then says nothing of its data."""
    path = Path(rm_dir) / TRAINING_DATA_FILE
    if not path.is_file():
        return None
    return RewardTrainingData.model_validate_json(path.read_text(encoding="utf-8"))
