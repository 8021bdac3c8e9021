"""LR schedules: warmup rises linearly to 1, cosine ends at min_ratio, constant stays 1; LambdaLR wiring."""

import pytest
import torch

from rlhf_core.training.schedules import build_scheduler, warmup_constant, warmup_cosine


def test_warmup_rises_linearly_from_near_zero_to_one() -> None:
    values = [warmup_constant(step, warmup_steps=10) for step in range(10)]
    assert values[0] == pytest.approx(0.1)
    assert values[-1] == pytest.approx(1.0)
    assert all(b - a == pytest.approx(0.1) for a, b in zip(values, values[1:]))
    cosine_warmup = [warmup_cosine(step, total=100, warmup_steps=10, min_ratio=0.1) for step in range(10)]
    assert cosine_warmup == pytest.approx(values)


def test_constant_after_warmup_stays_one() -> None:
    assert [warmup_constant(step, warmup_steps=10) for step in range(10, 200)] == [1.0] * 190
    assert warmup_constant(0, warmup_steps=0) == 1.0


def test_cosine_decays_monotonically_to_min_ratio_at_the_last_update() -> None:
    total, warmup, min_ratio = 50, 5, 0.1
    decay = [warmup_cosine(step, total, warmup, min_ratio) for step in range(warmup, total)]
    assert decay[0] == pytest.approx(1.0)
    assert decay[-1] == pytest.approx(min_ratio)
    assert all(b < a for a, b in zip(decay, decay[1:]))
    # Halfway through the decay (update 5 + 44 / 2) the cosine is at the mean of peak and floor.
    assert warmup_cosine(27, total, warmup, min_ratio) == pytest.approx((1 + min_ratio) / 2)
    assert warmup_cosine(total + 10, total, warmup, min_ratio) == pytest.approx(min_ratio)


def test_lambda_lr_applies_the_multiplier_of_each_update() -> None:
    parameter = torch.nn.Parameter(torch.zeros(()))
    optimizer = torch.optim.SGD([parameter], lr=2.0)
    scheduler = build_scheduler(optimizer, "warmup_cosine", total_steps=20, warmup_ratio=0.1, min_ratio=0.1)
    lrs = []
    for _ in range(20):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert lrs == pytest.approx([2.0 * warmup_cosine(k, 20, 2, 0.1) for k in range(20)])
    assert lrs[-1] == pytest.approx(0.2)


def test_unknown_schedule_is_rejected_by_name() -> None:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(()))], lr=1.0)
    with pytest.raises(ValueError, match="'linear'"):
        build_scheduler(
            optimizer,
            "linear",
            total_steps=10,
            warmup_ratio=0.0,
            min_ratio=0.0,  # type: ignore[arg-type]
        )
