"""RunningMeanStd against numpy over streams of batches, merging, and checkpoint round-trips."""

import json
import math

import numpy as np
import pytest
import torch

from rlhf_core.ppo.normalizers import RunningMeanStd, tensor_moments


def random_batches(seed: int, count: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(count):
        size = int(torch.randint(1, 20, (1,), generator=generator))
        batches.append(3.0 + 2.5 * torch.randn(size, generator=generator, dtype=torch.float64))
    return batches


def test_stream_of_batches_matches_numpy_on_the_concatenation() -> None:
    batches = random_batches(seed=0, count=25)
    running = RunningMeanStd()
    for batch in batches:
        running.update(batch)
    everything = torch.cat(batches).numpy()
    assert running.count == everything.size
    assert running.mean == pytest.approx(np.mean(everything), rel=1e-12)
    assert running.var == pytest.approx(np.var(everything), rel=1e-12)
    assert running.std == pytest.approx(math.sqrt(np.var(everything) + running.eps), rel=1e-12)


def test_update_accepts_any_shape_and_float32() -> None:
    running = RunningMeanStd()
    values = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    running.update(values)
    assert running.mean == pytest.approx(5.5)
    assert running.var == pytest.approx(np.var(np.arange(12)))


def test_merging_two_streams_equals_one_stream() -> None:
    stream_a, stream_b = random_batches(seed=1, count=10), random_batches(seed=2, count=7)
    rank_a, rank_b, single = RunningMeanStd(), RunningMeanStd(), RunningMeanStd()
    for batch in stream_a:
        rank_a.update(batch)
    for batch in stream_b:
        rank_b.update(batch)
    for batch in stream_a + stream_b:
        single.update(batch)
    rank_a.merge(rank_b.count, rank_b.mean, rank_b.var)
    assert rank_a.count == single.count
    assert rank_a.mean == pytest.approx(single.mean, rel=1e-12)
    assert rank_a.var == pytest.approx(single.var, rel=1e-12)


def test_merge_of_tensor_moments_is_an_update() -> None:
    batch = random_batches(seed=3, count=1)[0]
    merged, updated = RunningMeanStd(), RunningMeanStd()
    merged.merge(*tensor_moments(batch))
    updated.update(batch)
    assert merged.state_dict() == updated.state_dict()


def test_merging_nothing_changes_nothing() -> None:
    running = RunningMeanStd()
    running.update(torch.tensor([1.0, 2.0]))
    before = running.state_dict()
    running.merge(0, 100.0, 5.0)
    assert running.state_dict() == before


def test_state_dict_round_trips_through_json() -> None:
    running = RunningMeanStd()
    for batch in random_batches(seed=4, count=5):
        running.update(batch)
    restored = RunningMeanStd()
    restored.load_state_dict(json.loads(json.dumps(running.state_dict())))
    assert restored.state_dict() == running.state_dict()
    assert restored.std == running.std


def test_invalid_input_is_rejected() -> None:
    running = RunningMeanStd()
    with pytest.raises(ValueError, match="empty"):
        running.update(torch.tensor([]))
    with pytest.raises(ValueError, match="keys"):
        running.load_state_dict({"count": 1, "mean": 0.0})
    with pytest.raises(ValueError, match="var"):
        running.load_state_dict({"count": 1, "mean": 0.0, "var": -1.0})
    with pytest.raises(ValueError, match="count"):
        running.merge(-1, 0.0, 0.0)
