"""Critic pretraining ends when the value loss stops improving, or at its cap; until then no iteration
trains the policy. (The critic's initialisation: tests/ppo/test_ppo_stage.py.)"""

from __future__ import annotations

from rlhf_core.config import PPOConfig
from rlhf_core.ppo.critic import CriticPretraining, PlateauStop


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


def pretraining(**settings: float) -> CriticPretraining:
    return CriticPretraining(PPOConfig(**{"critic_pretrain_steps": 5, "critic_pretrain_patience": 2, **settings}))


def test_no_iteration_trains_the_policy_until_the_plateau_ends_pretraining() -> None:
    phase = pretraining(critic_pretrain_min_improvement=0.1)
    assert phase.iterations == 5 and not phase.trains_policy(6)  # the cap, while it lasts
    for step, loss in enumerate([1.0, 0.5, 0.48, 0.47], start=1):  # 0.48 and 0.47: under 10% better
        assert not phase.trains_policy(step)
        phase.record(step, loss)
    assert (phase.end, phase.iterations) == (4, 4)
    assert not phase.trains_policy(4) and phase.trains_policy(5)
    assert phase.iterations_run(final_step=9) == 4


def test_zero_pretraining_steps_train_the_policy_from_the_first_iteration() -> None:
    phase = pretraining(critic_pretrain_steps=0)
    assert (phase.end, phase.iterations, phase.trains_policy(1)) == (0, 0, True)


def test_a_run_stopped_during_pretraining_ran_every_iteration_critic_only() -> None:
    phase = pretraining()
    phase.record(1, 1.0)
    assert phase.end is None and phase.iterations_run(final_step=1) == 1


def test_pretraining_state_round_trip_keeps_the_checkpoint_keys() -> None:
    phase = pretraining(critic_pretrain_min_improvement=0.1)
    for step, loss in enumerate([1.0, 0.95, 0.94], start=1):
        phase.record(step, loss)
    state = phase.state_dict()
    assert state == {"critic_pretraining": {"best_loss": 0.94, "stale": 2, "steps": 3}, "pretrain_end": 3}
    resumed = pretraining(critic_pretrain_min_improvement=0.1)
    resumed.load_state_dict(state)
    assert (resumed.end, resumed.plateau.state_dict()) == (3, phase.plateau.state_dict())
