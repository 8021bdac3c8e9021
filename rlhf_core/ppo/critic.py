"""The critic's start (paper 5.3.3): where its weights come from, and the critic-only iterations that open a run.

Initialisation (`load_critic`, `ppo.critic_init`): from the reward model, the paper's choice, or from the
SFT model with a fresh value head (Figure 8's comparison).

Pretraining: a critic from the reward model starts with a head only ever trained at end-of-turn
positions, so its per-token values are poor at first; the first iterations train it alone, before the
policy moves. A fixed handful of steps is either too few or wasted time; the run instead pretrains until
the value loss stops improving: `PlateauStop` ends the phase after `patience` consecutive critic-only
iterations that did not lower the best value loss seen so far by at least the share `min_improvement`,
or after `max_steps` iterations, whichever comes first. `CriticPretraining` is the phase as the trainer
sees it: how many iterations it lasts and which iterations train the policy.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from rlhf_core.config import PPOConfig
from rlhf_core.models.heads import Critic
from rlhf_core.models.loading import load_causal_lm

log = logging.getLogger(__name__)


def load_critic(
    critic_init: Literal["reward", "sft"],
    sft_model_dir: Path,
    reward_model_dir: Path,
    dtype: torch.dtype,
    device: torch.device,
    seed: int,
) -> Critic:
    """The critic PPO starts from: the saved reward model (backbone and head), or the SFT model with a
    fresh value head drawn from `seed`; in `dtype`, the trained models' dtype."""
    if critic_init == "reward":
        return Critic.from_pretrained(reward_model_dir, dtype=dtype, device=device)
    sft_copy, _ = load_causal_lm(sft_model_dir, dtype=dtype, device=device)
    return Critic.from_causal_lm(sft_copy, seed=seed)


@dataclass
class PlateauStop:
    """Tracks the value loss of critic-only iterations; checkpointed (`state_dict`) for exact resume."""

    max_steps: int
    patience: int
    min_improvement: float
    best_loss: float | None = None
    stale: int = 0
    steps: int = 0

    def update(self, value_loss: float) -> bool:
        """Record one critic-only iteration's value loss; True when pretraining should end now."""
        self.steps += 1
        if self.best_loss is None or value_loss < self.best_loss * (1.0 - self.min_improvement):
            self.best_loss, self.stale = value_loss, 0
        else:
            self.best_loss = min(self.best_loss, value_loss)
            self.stale += 1
        return self.steps >= self.max_steps or self.stale >= self.patience

    def state_dict(self) -> dict[str, float | int | None]:
        return {"best_loss": self.best_loss, "stale": self.stale, "steps": self.steps}

    def load_state_dict(self, state: dict[str, float | int | None]) -> None:
        best = state["best_loss"]
        self.best_loss = None if best is None else float(best)
        self.stale = int(state["stale"] or 0)
        self.steps = int(state["steps"] or 0)


class CriticPretraining:
    """The critic-only iterations that open a run (1-based, like the trainer's steps).

    `end` is the last of them once known: 0 when there are none (`critic_pretrain_steps` 0), None while
    they last.
    """

    def __init__(self, config: PPOConfig) -> None:
        self.plateau = PlateauStop(
            config.critic_pretrain_steps, config.critic_pretrain_patience, config.critic_pretrain_min_improvement
        )
        self.end: int | None = 0 if config.critic_pretrain_steps == 0 else None

    @property
    def iterations(self) -> int:
        """How many iterations pretraining takes: its cap while it lasts, then those it ran."""
        return self.plateau.max_steps if self.end is None else self.end

    def trains_policy(self, step: int) -> bool:
        """Whether iteration `step` updates the policy: only after pretraining has ended."""
        return self.end is not None and step > self.end

    def record(self, step: int, value_loss: float) -> None:
        """After critic-only iteration `step`: its value loss may end pretraining (`PlateauStop`)."""
        if self.plateau.update(value_loss):
            self.end = step
            log.info("critic pretraining ended after %d iterations (value loss %.4g)", step, value_loss)

    def iterations_run(self, final_step: int) -> int:
        """Critic-only iterations a run that ended after `final_step` ran (all of them if it ended inside)."""
        return self.end if self.end is not None else final_step

    def state_dict(self) -> dict[str, Any]:
        """The stopping rule's state and `end`, under the trainer state's keys "critic_pretraining" and
        "pretrain_end"."""
        return {"critic_pretraining": self.plateau.state_dict(), "pretrain_end": self.end}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.plateau.load_state_dict(state["critic_pretraining"])
        self.end = state["pretrain_end"]
