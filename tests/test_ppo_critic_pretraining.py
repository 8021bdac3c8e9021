"""Critic pretraining ends when the value loss stops improving, or at its cap."""

from __future__ import annotations

from rlhf_core.ppo.critic_pretraining import PlateauStop


def iterations_until_stop(losses: list[float], **settings: float) -> int:
    stop = PlateauStop(**{"max_steps": 30, "patience": 3, "min_improvement": 0.02, **settings})
    for index, loss in enumerate(losses, start=1):
        if stop.update(loss):
            return index
    return -1


def test_a_falling_value_loss_pretrains_up_to_the_cap() -> None:
    assert iterations_until_stop([1.0 * 0.9**i for i in range(40)]) == 30


def test_a_flat_value_loss_stops_after_patience_iterations() -> None:
    assert iterations_until_stop([1.0, 0.5, 0.3, 0.3, 0.299, 0.31, 0.2]) == 6


def test_an_improvement_resets_the_patience() -> None:
    assert iterations_until_stop([1.0, 1.0, 1.0, 0.5, 0.5, 0.5, 0.5]) == 7


def test_state_round_trip_continues_identically() -> None:
    losses = [1.0, 0.8, 0.8, 0.79, 0.9, 0.5, 0.6, 0.6, 0.6]
    whole = PlateauStop(max_steps=30, patience=3, min_improvement=0.02)
    decisions = [whole.update(loss) for loss in losses]
    first = PlateauStop(max_steps=30, patience=3, min_improvement=0.02)
    for loss in losses[:4]:
        first.update(loss)
    resumed = PlateauStop(max_steps=30, patience=3, min_improvement=0.02)
    resumed.load_state_dict(first.state_dict())
    assert [resumed.update(loss) for loss in losses[4:]] == decisions[4:]
