"""A tiny, fully seeded training run that `tests/training/test_training_resume.py` starts, kills and restarts.

It exercises everything resume must restore: dropout (torch RNG), a collate that draws from python's
`random` and numpy's global generator (token noise), periodic validation with best-metric tracking,
extra state (a running mean of the loss), and a plan that crosses epoch boundaries.

Output protocol (stdout, one line each, flushed): `STEP <k>` after step k is logged, `HANGING <k>` when
the env var TRAIN_TINY_HANG_AT_CHECKPOINT=k makes the checkpoint write of step k sleep just before its
marker file, and `RESULT <json>` at the end. Every step this process runs is appended to --executed.
TRAIN_TINY_STEP_SLEEP (seconds) slows each step down so that a kill lands in the middle of the run.
"""

import argparse
import json
import os
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file
from torch import Tensor, nn

from rlhf_core.training import checkpoint
from rlhf_core.training.batching import fixed_size_plan
from rlhf_core.training.logger import JsonlLogger, MultiLogger
from rlhf_core.training.loop import train
from rlhf_core.training.loop_config import LoopConfig

VOCAB = 16
PAD = -100


class TinyLM(nn.Module):
    """Embedding -> dropout -> linear: a next-token model whose training draws from torch's RNG."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 8)
        self.dropout = nn.Dropout(0.2)
        self.out = nn.Linear(8, VOCAB)

    def forward(self, ids: Tensor) -> Tensor:
        return self.out(self.dropout(self.embed(ids)))


class RunningLoss:
    """Extra state for the checkpoint: a running mean of the micro-batch losses."""

    def __init__(self) -> None:
        self.count = 0
        self.mean = torch.zeros(())

    def update(self, value: Tensor) -> None:
        self.count += 1
        self.mean = self.mean + (value.detach() - self.mean) / self.count

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count, "mean": self.mean.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.count = state["count"]
        self.mean = state["mean"].clone()


class StepAnnouncer:
    """A logger that tells the test which step finished, and records the steps this process ran."""

    def __init__(self, executed: Path) -> None:
        self.executed = executed

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        with self.executed.open("a") as handle:
            handle.write(f"{step}\n")
        print(f"STEP {step}", flush=True)
        time.sleep(float(os.environ.get("TRAIN_TINY_STEP_SLEEP", "0")))

    def log_params(self, params: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


def make_sequences(count: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 10, (count,), generator=generator).tolist()
    return [torch.randint(0, VOCAB, (n,), generator=generator).tolist() for n in lengths]


def collate(sequences: list[list[int]], noisy: bool) -> dict[str, Tensor]:
    """Right-pad to the longest sequence; with `noisy`, replace one token per sequence at random."""
    width = max(len(s) for s in sequences)
    ids = torch.zeros(len(sequences), width, dtype=torch.long)
    labels = torch.full((len(sequences), width), PAD)
    for row, sequence in enumerate(sequences):
        tokens = list(sequence)
        if noisy:
            tokens[random.randrange(len(tokens))] = int(np.random.randint(VOCAB))
        ids[row, : len(tokens)] = torch.tensor(tokens)
        labels[row, : len(tokens) - 1] = torch.tensor(tokens[1:])
    return {"ids": ids, "labels": labels}


def token_count(batch: dict[str, Tensor]) -> dict[str, int]:
    return {"tokens": int((batch["labels"] != PAD).sum())}


def summed_nll(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    logits = model(batch["ids"])
    return nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="sum")


def hang_at_checkpoint(step_to_hang: int) -> None:
    """Make the checkpoint write of `step_to_hang` stop before its marker, as if the process died there."""
    write_marker = checkpoint._write_marker

    def slow_write_marker(directory: Path, step: int) -> None:
        if step == step_to_hang:
            print(f"HANGING {step}", flush=True)
            time.sleep(600)
        write_marker(directory, step)

    checkpoint._write_marker = slow_write_marker


# The loop's settings: 20 steps with a checkpoint every 4, so a kill lands between checkpoints.
LOOP = LoopConfig(
    epochs=4,
    max_steps=20,
    lr=3e-2,
    weight_decay=0.1,
    schedule="warmup_cosine",
    warmup_ratio=0.2,
    max_grad_norm=1.0,
    checkpoint_every=4,
    keep_checkpoints=2,
    eval_every=5,
    eval_batches=2,
    seed=7,
    progress_bar=False,
)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workdir", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if "TRAIN_TINY_HANG_AT_CHECKPOINT" in os.environ:
        hang_at_checkpoint(int(os.environ["TRAIN_TINY_HANG_AT_CHECKPOINT"]))

    torch.manual_seed(0)
    model = TinyLM()
    train_set = make_sequences(24, seed=1)
    val_set = make_sequences(8, seed=2)
    running = RunningLoss()

    def loss_fn(model: nn.Module, batch: dict[str, Tensor], totals: dict[str, int]) -> tuple[Tensor, dict[str, float]]:
        loss = summed_nll(model, batch) / totals["tokens"]
        running.update(loss)
        return loss, {"nll": loss.item()}

    def evaluate(model: nn.Module, max_batches: int | None) -> dict[str, float]:
        batches = [val_set[i : i + 2] for i in range(0, len(val_set), 2)][:max_batches]
        nll = sum(summed_nll(model, collate(b, noisy=False)).item() for b in batches)
        tokens = sum(token_count(collate(b, noisy=False))["tokens"] for b in batches)
        return {"val/loss": nll / tokens}

    history = JsonlLogger(args.workdir / "history.jsonl")
    logger = MultiLogger([history, StepAnnouncer(args.workdir / "executed.txt")])
    result = train(
        model,
        fixed_size_plan(len(train_set), seed=3, micro_batch_size=2, accumulation_steps=2),
        lambda indices: collate([train_set[i] for i in indices], noisy=True),
        token_count,
        loss_fn,
        LOOP,
        evaluate=evaluate,
        select_best=("val/loss", "min"),
        checkpoint_dir=args.workdir / "checkpoints",
        logger=logger,
        extra_state=running,
    )
    logger.close()
    weights = {name: tensor.contiguous() for name, tensor in model.state_dict().items()}
    save_file(weights, str(args.workdir / "final.safetensors"))
    summary = {
        "final_step": result.final_step,
        "resumed_from": result.resumed_from,
        "best_metric": result.best_metric,
        "metrics": result.metrics,
        "running": [running.count, running.mean.item()],
    }
    print("RESULT " + json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
