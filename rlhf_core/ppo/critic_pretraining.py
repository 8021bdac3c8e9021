"""When critic pretraining ends (paper 5.3.3: train the critic alone before the policy moves).

The critic starts from the reward model, whose head was only ever trained at end-of-turn positions, so
its per-token values are poor at first. A fixed handful of steps is either too few or wasted time; the
run instead pretrains until the value loss stops improving: `PlateauStop` ends the phase after
`patience` consecutive critic-only iterations that did not lower the best value loss seen so far by
at least the share `min_improvement`, or after `max_steps` iterations, whichever comes first.
"""

from __future__ import annotations

from dataclasses import dataclass


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
