"""Masked reductions, whitening and KL estimators against numpy and hand-computed values."""

import math

import numpy as np
import pytest
import torch

from fixtures.masks import right_padded_mask
from rlhf_core.ppo.kl import kl_k1, kl_k3
from rlhf_core.ppo.masked import (
    last_token_index,
    masked_max,
    masked_mean,
    masked_min,
    masked_sum,
    masked_var,
    masked_whiten,
    reply_tokens,
)


@pytest.fixture
def batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(4, 6, generator=generator, dtype=torch.float64)
    mask = right_padded_mask([6, 1, 3, 4], 6)
    return x, mask


def test_sum_mean_var_match_numpy_on_real_entries(batch) -> None:
    x, mask = batch
    real = x.numpy()[mask.numpy()]
    assert masked_sum(x, mask).item() == pytest.approx(real.sum())
    assert masked_mean(x, mask).item() == pytest.approx(real.mean())
    assert masked_var(x, mask).item() == pytest.approx(real.var(ddof=1))
    assert masked_var(x, mask, unbiased=False).item() == pytest.approx(real.var(ddof=0))


def test_float_mask_behaves_like_bool_mask(batch) -> None:
    x, mask = batch
    assert masked_mean(x, mask.double()).item() == pytest.approx(masked_mean(x, mask).item())


def test_per_row_mean_matches_loop(batch) -> None:
    x, mask = batch
    row_means = masked_mean(x, mask, dim=1)
    for row in range(x.shape[0]):
        expected = x[row][mask[row]].numpy().mean()
        assert row_means[row].item() == pytest.approx(expected)


def test_padding_with_nan_does_not_leak(batch) -> None:
    x, mask = batch
    poisoned = x.masked_fill(~mask, float("nan"))
    assert masked_sum(poisoned, mask).item() == pytest.approx(masked_sum(x, mask).item())
    assert masked_var(poisoned, mask).item() == pytest.approx(masked_var(x, mask).item())


def test_masked_max_min_ignore_padding() -> None:
    x = torch.tensor([[1.0, 5.0, 100.0], [-3.0, -100.0, -100.0]])
    mask = right_padded_mask([2, 1], 3)
    assert masked_max(x, mask).item() == 5.0
    assert masked_min(x, mask).item() == -3.0


def test_masked_var_refuses_too_few_entries() -> None:
    x = torch.tensor([[2.0, 7.0]])
    one_token = right_padded_mask([1], 2)
    with pytest.raises(ValueError, match="at least 2"):
        masked_var(x, one_token)
    assert masked_var(x, one_token, unbiased=False).item() == 0.0


def test_shape_mismatch_is_rejected() -> None:
    with pytest.raises(ValueError, match="shape"):
        masked_sum(torch.zeros(2, 3), torch.ones(2, 1))


def test_whiten_matches_numpy_and_zeroes_padding(batch) -> None:
    x, mask = batch
    whitened = masked_whiten(x, mask)
    real = x.numpy()[mask.numpy()]
    expected = (real - real.mean()) / np.sqrt(real.var(ddof=1) + 1e-8)
    np.testing.assert_allclose(whitened.numpy()[mask.numpy()], expected, rtol=1e-12)
    assert torch.all(whitened[~mask] == 0)


def test_whiten_ignores_what_padding_holds(batch) -> None:
    x, mask = batch
    changed = x.masked_fill(~mask, 1e6)
    torch.testing.assert_close(masked_whiten(changed, mask), masked_whiten(x, mask))


def test_whiten_without_shift_keeps_the_mean(batch) -> None:
    x, mask = batch
    scaled = masked_whiten(x, mask, shift_mean=False)
    assert masked_mean(scaled, mask).item() == pytest.approx(masked_mean(x, mask).item())
    assert masked_var(scaled, mask).item() == pytest.approx(1.0, rel=1e-6)


def test_last_token_index_and_its_errors() -> None:
    assert last_token_index(right_padded_mask([3, 1, 2], 3)).tolist() == [2, 0, 1]
    with pytest.raises(ValueError, match="no real tokens"):
        last_token_index(right_padded_mask([2, 0], 3))
    with pytest.raises(ValueError, match="right-padded"):
        last_token_index(torch.tensor([[0, 1, 1]]))


def test_reply_tokens_leave_out_a_finished_replys_end_of_turn() -> None:
    mask = right_padded_mask([3, 3, 1], 4)  # a finished reply's last real token is its end-of-turn token
    assert reply_tokens(mask, torch.tensor([True, False, True])).tolist() == [2, 3, 0]


def test_kl_estimators_on_hand_values() -> None:
    # policy gives the sampled token p = 0.5, reference q = 0.25, and the reverse
    logp = torch.tensor([math.log(0.5), math.log(0.25)], dtype=torch.float64)
    ref_logp = torch.tensor([math.log(0.25), math.log(0.5)], dtype=torch.float64)
    k1 = kl_k1(logp, ref_logp)
    k3 = kl_k3(logp, ref_logp)
    # k1 = log(p/q);  k3 = (q/p - 1) - log(q/p)
    assert k1.tolist() == pytest.approx([math.log(2), -math.log(2)])
    assert k3.tolist() == pytest.approx([(0.5 - 1) + math.log(2), (2 - 1) - math.log(2)])
    assert k3.tolist() == pytest.approx([0.1931471806, 0.3068528194])


def test_kl_estimators_zero_when_policies_agree_and_k3_nonnegative() -> None:
    generator = torch.Generator().manual_seed(1)
    logp = -torch.rand(50, generator=generator) * 5
    assert torch.all(kl_k1(logp, logp) == 0)
    assert torch.all(kl_k3(logp, logp) == 0)
    ref_logp = -torch.rand(50, generator=generator) * 5
    assert torch.all(kl_k3(logp, ref_logp) >= 0)


def test_k1_and_k3_are_unbiased_for_the_true_kl() -> None:
    generator = torch.Generator().manual_seed(2)
    p = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    q = torch.tensor([0.2, 0.3, 0.5], dtype=torch.float64)
    true_kl = float((p * (p / q).log()).sum())
    samples = torch.multinomial(p, 200_000, replacement=True, generator=generator)
    logp, ref_logp = p.log()[samples], q.log()[samples]
    assert kl_k1(logp, ref_logp).mean().item() == pytest.approx(true_kl, abs=0.01)
    assert kl_k3(logp, ref_logp).mean().item() == pytest.approx(true_kl, abs=0.01)
