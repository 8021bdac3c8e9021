"""Batch plans: seeded and deterministic, every example once per epoch, step(k) stable, budget respected,
length groups that cut the padding without changing the steps."""

import numpy as np
import pytest

from rlhf_core.training.batching import (
    BatchPlan,
    batch_plan,
    fixed_size_plan,
    length_grouped_plan,
    pack_by_token_budget,
    token_budget_plan,
)


def lengths_for_test(count: int = 50) -> list[int]:
    return [(7 * i) % 31 + 2 for i in range(count)]  # 2..32 tokens, in no particular order


def test_fixed_plan_is_deterministic_for_a_seed_and_differs_across_seeds() -> None:
    plan = fixed_size_plan(20, seed=3, micro_batch_size=2, accumulation_steps=2)
    assert [plan.step(k) for k in range(12)] == [fixed_size_plan(20, 3, 2, 2).step(k) for k in range(12)]
    assert [plan.step(k) for k in range(5)] != [fixed_size_plan(20, 4, 2, 2).step(k) for k in range(5)]


def test_fixed_plan_uses_every_example_once_per_epoch_in_a_new_order() -> None:
    plan = fixed_size_plan(20, seed=0, micro_batch_size=2, accumulation_steps=2)
    assert plan.steps_per_epoch == 5
    epochs = []
    for epoch in range(3):
        steps = [plan.step(epoch * 5 + i) for i in range(5)]
        assert all(len(step) == 2 and all(len(mb) == 2 for mb in step) for step in steps)
        order = [index for step in steps for micro_batch in step for index in micro_batch]
        assert sorted(order) == list(range(20))
        epochs.append(order)
    assert epochs[0] != epochs[1] != epochs[2]


def test_fixed_plan_drops_the_incomplete_last_step() -> None:
    # 23 examples -> 11 micro-batches of 2 -> 3 steps of 3; 5 examples unused this epoch
    plan = fixed_size_plan(23, seed=0, micro_batch_size=2, accumulation_steps=3)
    assert plan.steps_per_epoch == 3
    used = [i for k in range(3) for mb in plan.step(k) for i in mb]
    assert len(used) == len(set(used)) == 18
    assert plan.step(3) == plan.epoch_micro_batches(1)[:3]  # step 3 is the first step of epoch 1


def test_step_k_does_not_depend_on_what_was_asked_before() -> None:
    plan = fixed_size_plan(30, seed=1, micro_batch_size=3, accumulation_steps=2)
    late_first = plan.step(17)
    for k in range(17):
        plan.step(k)
    assert plan.step(17) == late_first
    assert plan.steps_per_epoch == 5
    assert plan.step(17) == plan.epoch_micro_batches(3)[4:6]  # epoch 3, its step 2 (micro-batches 4, 5)


def test_packing_respects_the_token_budget_and_keeps_every_example_once() -> None:
    lengths = lengths_for_test()
    micro_batches = pack_by_token_budget(lengths, seed=0, token_budget=64)
    for micro_batch in micro_batches:
        assert max(lengths[i] for i in micro_batch) * len(micro_batch) <= 64
    assert sorted(i for mb in micro_batches for i in mb) == list(range(len(lengths)))
    # Greedy: no micro-batch could have taken the next example of the sorted order.
    for current, following in zip(micro_batches, micro_batches[1:]):
        candidate = max(lengths[i] for i in current + following[:1]) * (len(current) + 1)
        assert candidate > 64


def test_token_plan_is_deterministic_and_shuffles_micro_batches_per_epoch() -> None:
    lengths = lengths_for_test()
    plan = token_budget_plan(lengths, seed=5, token_budget=64, accumulation_steps=2)
    again = token_budget_plan(lengths, seed=5, token_budget=64, accumulation_steps=2)
    spe = plan.steps_per_epoch
    assert spe == len(pack_by_token_budget(lengths, seed=5, token_budget=64)) // 2
    assert [plan.step(k) for k in range(3 * spe)] == [again.step(k) for k in range(3 * spe)]
    first, second = plan.epoch_micro_batches(0), plan.epoch_micro_batches(1)
    assert first != second
    assert set(map(tuple, first)) | set(map(tuple, second)) <= set(plan.packed_micro_batches)
    for k in range(2 * spe):
        for micro_batch in plan.step(k):
            assert max(lengths[i] for i in micro_batch) * len(micro_batch) <= 64


def padding_share(plan: BatchPlan, lengths: list[int]) -> float:
    """The share of an epoch's padded token passes that are padding (each micro-batch at its longest)."""
    micro_batches = plan.epoch_micro_batches(0)
    real = sum(lengths[i] for micro_batch in micro_batches for i in micro_batch)
    padded = sum(max(lengths[i] for i in micro_batch) * len(micro_batch) for micro_batch in micro_batches)
    return 1 - real / padded


def test_length_grouped_plan_keeps_the_fixed_plans_shape_and_cuts_its_padding() -> None:
    lengths = np.random.default_rng(0).integers(10, 385, size=744).tolist()  # an SFT split's spread of lengths
    grouped = length_grouped_plan(lengths, seed=42, micro_batch_size=4, accumulation_steps=2)
    fixed = fixed_size_plan(744, seed=42, micro_batch_size=4, accumulation_steps=2)
    assert grouped.steps_per_epoch == fixed.steps_per_epoch == 93
    for epoch in range(2):
        micro_batches = grouped.epoch_micro_batches(epoch)
        assert len(micro_batches) == 186 and all(len(micro_batch) == 4 for micro_batch in micro_batches)
        assert sorted(i for micro_batch in micro_batches for i in micro_batch) == list(range(744))
    assert grouped.epoch_micro_batches(0) != grouped.epoch_micro_batches(1)
    assert padding_share(fixed, lengths) > 0.3 and padding_share(grouped, lengths) < 0.03


def test_length_grouped_plan_is_seeded_and_mixes_lengths_across_steps() -> None:
    lengths = lengths_for_test(400)
    plan = length_grouped_plan(lengths, seed=1, micro_batch_size=2, accumulation_steps=2)
    assert [plan.step(k) for k in range(300)] == [length_grouped_plan(lengths, 1, 2, 2).step(k) for k in range(300)]
    assert plan.step(0) != length_grouped_plan(lengths, 2, 2, 2).step(0)
    longest = [max(lengths[i] for i in micro_batch) for micro_batch in plan.epoch_micro_batches(0)]
    assert longest != sorted(longest) and longest != sorted(longest, reverse=True)  # not in length order


def test_a_grouped_epoch_drops_the_incomplete_micro_batch_of_its_last_group() -> None:
    lengths = lengths_for_test(23)  # one group: 11 micro-batches of 2, the longest example left out
    plan = length_grouped_plan(lengths, seed=0, micro_batch_size=2, accumulation_steps=1)
    used = [i for micro_batch in plan.epoch_micro_batches(0) for i in micro_batch]
    assert len(used) == len(set(used)) == 22 and plan.steps_per_epoch == 11
    (left_out,) = set(range(23)) - set(used)
    assert lengths[left_out] == max(lengths)


def test_batch_plan_builds_the_plan_its_setting_names() -> None:
    lengths = lengths_for_test()
    shape = {"micro_batch_size": 2, "token_budget": 64, "accumulation_steps": 2}
    assert batch_plan("fixed", lengths, 3, **shape) == fixed_size_plan(50, 3, 2, 2)  # runs before it: unchanged
    assert batch_plan("length_grouped", lengths, 3, **shape) == length_grouped_plan(lengths, 3, 2, 2)
    assert batch_plan("token_budget", lengths, 3, **shape) == token_budget_plan(lengths, 3, 64, 2)


def test_bad_plans_fail_with_clear_messages() -> None:
    with pytest.raises(ValueError, match="example 1 has 100 tokens"):
        token_budget_plan([5, 100], seed=0, token_budget=64, accumulation_steps=1)
    with pytest.raises(ValueError, match="no complete optimizer step"):
        fixed_size_plan(3, seed=0, micro_batch_size=2, accumulation_steps=2)
    with pytest.raises(ValueError, match="exactly one"):
        BatchPlan(num_examples=4, seed=0, accumulation_steps=1)
    with pytest.raises(ValueError, match="one length per example"):
        BatchPlan(num_examples=4, seed=0, accumulation_steps=1, micro_batch_size=2, lengths=(3, 4))
    with pytest.raises(ValueError, match=">= 0"):
        fixed_size_plan(4, seed=0, micro_batch_size=2, accumulation_steps=1).step(-1)
