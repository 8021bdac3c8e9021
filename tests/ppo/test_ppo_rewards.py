"""Score normalisation/scaling with running statistics, the rollout's length residual, and the
KL-penalised token rewards."""

from pathlib import Path

import numpy as np
import pytest
import torch

from fixtures.gloo_ranks import on_two_gloo_ranks
from fixtures.masks import right_padded_mask
from rlhf_core.distributed.collectives import gather_rows
from rlhf_core.ppo.normalizers import RunningMeanStd
from rlhf_core.ppo.rewards import normalize_scores, remove_length_slope, scale_scores, token_level_rewards


def running_with(mean: float, var: float) -> RunningMeanStd:
    running = RunningMeanStd(eps=0.0)
    running.load_state_dict({"count": 10, "mean": mean, "var": var})
    return running


def test_normalize_then_clip_on_hand_values() -> None:
    running = running_with(mean=1.0, var=4.0)  # std 2
    scores = torch.tensor([1.0, 3.0, -5.0, 21.0])
    assert normalize_scores(scores, running, clip=None).tolist() == [0.0, 1.0, -3.0, 10.0]
    assert normalize_scores(scores, running, clip=5.0).tolist() == [0.0, 1.0, -3.0, 5.0]
    assert normalize_scores(-scores, running, clip=2.5).tolist() == [-1.0, -2.0, 2.0, -2.5]


def test_scale_divides_by_std_only() -> None:
    running = running_with(mean=1.0, var=4.0)
    scores = torch.tensor([1.0, 3.0, -5.0, 21.0])
    assert scale_scores(scores, running).tolist() == [0.5, 1.5, -2.5, 10.5]
    assert scale_scores(scores, running, clip=3.0).tolist() == [0.5, 1.5, -2.5, 3.0]


def test_first_batch_updated_then_normalised_is_its_z_score() -> None:
    generator = torch.Generator().manual_seed(0)
    scores = 4.0 + 3.0 * torch.randn(16, generator=generator, dtype=torch.float64)
    running = RunningMeanStd()
    running.update(scores)
    raw = scores.numpy()
    expected = (raw - raw.mean()) / np.sqrt(raw.var() + running.eps)
    normalized = normalize_scores(scores, running, clip=None)
    np.testing.assert_allclose(normalized.numpy(), expected, rtol=1e-12)


def test_normalising_before_any_update_is_refused() -> None:
    with pytest.raises(ValueError, match="update"):
        normalize_scores(torch.tensor([1.0]), RunningMeanStd(), clip=5.0)
    with pytest.raises(ValueError, match="update"):
        scale_scores(torch.tensor([1.0]), RunningMeanStd())
    with pytest.raises(ValueError, match="positive"):
        normalize_scores(torch.tensor([1.0]), running_with(0.0, 1.0), clip=0.0)


def test_token_rewards_put_kl_on_real_tokens_and_score_on_the_last() -> None:
    generator = torch.Generator().manual_seed(1)
    lengths, width, kl_coef = [4, 1, 2], 4, 0.1
    mask = right_padded_mask(lengths, width)
    kl = torch.randn(3, width, generator=generator, dtype=torch.float64)
    kl = kl.masked_fill(~mask, float("nan"))
    scores = torch.tensor([1.0, -2.0, 3.0], dtype=torch.float64)

    rewards = token_level_rewards(scores, kl, mask, kl_coef)

    for row, length in enumerate(lengths):
        for t in range(width):
            if t >= length:
                expected = 0.0
            elif t == length - 1:
                expected = -kl_coef * kl[row, t].item() + scores[row].item()
            else:
                expected = -kl_coef * kl[row, t].item()
            assert rewards[row, t].item() == pytest.approx(expected, rel=1e-12, abs=1e-15)


def test_token_rewards_on_hand_values() -> None:
    mask = right_padded_mask([3, 1], 3)
    kl = torch.tensor([[1.0, -2.0, 0.5], [4.0, 7.0, 7.0]])
    rewards = token_level_rewards(torch.tensor([10.0, 20.0]), kl, mask, kl_coef=0.5)
    assert rewards.tolist() == [[-0.5, 1.0, 9.75], [18.0, 0.0, 0.0]]


def test_token_rewards_reject_bad_shapes_and_masks() -> None:
    mask = right_padded_mask([2, 1], 3)
    with pytest.raises(ValueError, match="scores"):
        token_level_rewards(torch.zeros(3), torch.zeros(2, 3), mask, 0.1)
    with pytest.raises(ValueError, match="mask"):
        token_level_rewards(torch.zeros(2), torch.zeros(2, 4), mask, 0.1)
    with pytest.raises(ValueError, match="right-padded"):
        token_level_rewards(torch.zeros(1), torch.zeros(1, 3), torch.tensor([[1, 0, 1]]), 0.1)


def one_process(rows: torch.Tensor) -> torch.Tensor:
    """`gather_rows` on a single process: the rank's own rows."""
    return rows


def length_paying_batch(n: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores that fall with log reply length plus noise, as the policy reward model's do."""
    generator = torch.Generator().manual_seed(3)
    tokens = torch.randint(2, 64, (n,), generator=generator)
    scores = 1.0 - 0.8 * torch.log1p(tokens.double()) + 0.3 * torch.randn(n, generator=generator, dtype=torch.float64)
    return scores.float(), tokens


def test_length_residual_is_the_least_squares_residual_plus_the_mean() -> None:
    scores, tokens = length_paying_batch()
    x, y = np.log1p(tokens.numpy().astype(np.float64)), scores.numpy().astype(np.float64)
    slope, intercept = np.polyfit(x, y, 1)
    expected = y - slope * (x - x.mean())  # the residual y - (a + b x), shifted back to the batch mean
    residual = remove_length_slope(scores, tokens, one_process)
    assert residual.dtype == scores.dtype
    np.testing.assert_allclose(residual.numpy(), expected, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(residual.numpy() - y.mean(), y - (intercept + slope * x), atol=1e-6)
    assert abs(np.corrcoef(residual.numpy(), x)[0, 1]) < 1e-5
    assert residual.double().mean().item() == pytest.approx(y.mean(), abs=1e-6)


def test_length_residual_keeps_the_order_of_equal_lengths_and_constant_lengths() -> None:
    scores = torch.tensor([0.5, -1.0, 2.0, 0.1])
    tokens = torch.tensor([10, 10, 30, 30])
    residual = remove_length_slope(scores, tokens, one_process)
    assert residual[0] - residual[1] == pytest.approx(1.5) and residual[2] - residual[3] == pytest.approx(1.9)
    assert torch.equal(remove_length_slope(scores, torch.full((4,), 7), one_process), scores)


def residual_of_half(rank: int) -> torch.Tensor:
    """One rank of the test below: its half of `length_paying_batch`, residualised with the real `gather_rows`."""
    scores, tokens = length_paying_batch()
    half = slice(0, 7) if rank == 0 else slice(7, None)  # unequal halves: gather_rows pads and trims rows
    return remove_length_slope(scores[half], tokens[half], gather_rows)


@pytest.mark.slow  # two gloo processes
def test_length_residual_over_two_ranks_equals_the_whole_batch(tmp_path: Path) -> None:
    """Two processes holding unequal halves of the rollout fit the one process's slope on the whole of it."""
    scores, tokens = length_paying_batch()
    whole = remove_length_slope(scores, tokens, one_process)
    split = torch.cat(on_two_gloo_ranks(residual_of_half, tmp_path))
    torch.testing.assert_close(split, whole)
    assert not torch.allclose(split[:7], remove_length_slope(scores[:7], tokens[:7], one_process))  # not per rank
