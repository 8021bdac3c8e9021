"""rlhf_core/rollout/sampling.py: the `inverse_cdf` draw locates a uniform in the float64 cumulative
distribution (checked against the definition written out), never draws a token of probability zero,
and its draws follow the probabilities (a frequency test over many seeded draws)."""

from __future__ import annotations

import pytest
import torch

from rlhf_core.rollout.sampling import draw, inverse_cdf_draw

pytestmark = pytest.mark.usefixtures("one_thread")


def reference_draw(weights: list[float], uniform: float) -> int:
    """The definition: the first token whose running sum exceeds uniform * total."""
    target, running = uniform * sum(weights), 0.0
    for token, weight in enumerate(weights):
        running += weight
        if running > target:
            return token
    raise AssertionError("uniform must lie in [0, 1)")


@pytest.mark.parametrize("block", [2, 3, 128])  # blocks that split the vocabulary, pad it, or hold it whole
def test_the_uniform_is_located_in_the_cumulative_distribution(block: int) -> None:
    weights = [[0.2, 0.0, 0.5, 0.0, 0.3], [0.0, 0.0, 1.0, 0.0, 0.0], [0.1, 0.1, 0.1, 0.1, 0.6]]
    uniforms = [0.0, 0.1, 0.19999, 0.2, 0.5, 0.69999, 0.7, 0.9, 1 - 2**-53]
    for uniform in uniforms:
        got = inverse_cdf_draw(torch.tensor(weights), torch.full((3,), uniform, dtype=torch.float64), block)
        assert got.tolist() == [reference_draw(row, uniform) for row in weights], uniform


def test_random_distributions_match_the_definition() -> None:
    generator = torch.Generator().manual_seed(0)
    probs = torch.softmax(4 * torch.randn(6, 1000, generator=generator), dim=-1)
    probs[:, ::3] = 0.0  # cut tokens, as top-p leaves them
    uniforms = torch.rand(6, dtype=torch.float64, generator=generator)
    got = inverse_cdf_draw(probs, uniforms)
    expected = [reference_draw(row.double().tolist(), float(u)) for row, u in zip(probs, uniforms)]
    assert got.tolist() == expected


def test_rounding_at_the_top_never_draws_a_zero_probability_token() -> None:
    """u * total can round up to the total; the draw then is the last token that can be drawn."""
    probs = torch.tensor([[0.3, 0.7, 0.0, 0.0, 0.0, 0.0]])
    assert inverse_cdf_draw(probs, torch.tensor([1 - 2**-53], dtype=torch.float64), block=2).tolist() == [1]


def test_draws_follow_the_probabilities() -> None:
    torch.manual_seed(0)
    probs = torch.softmax(torch.randn(300), dim=-1)
    probs[::7] = 0.0
    probs /= probs.sum()
    counts = torch.zeros(300)
    for _ in range(10):
        counts += torch.bincount(draw(probs.repeat(20_000, 1), "inverse_cdf"), minlength=300)
    expected = probs * counts.sum()
    live = probs > 0
    z = (counts - expected)[live] / expected[live].sqrt()
    assert counts[~live].sum() == 0
    assert z.abs().max() < 5 and 0.8 < float((z**2).mean()) < 1.2  # chi-square per degree of freedom ~1


def test_both_samplers_draw_from_torchs_current_stream() -> None:
    probs = torch.softmax(torch.randn(4, 50, generator=torch.Generator().manual_seed(1)), dim=-1)
    for sampler in ("inverse_cdf", "multinomial"):
        torch.manual_seed(3)
        first = draw(probs, sampler)
        torch.manual_seed(3)
        assert torch.equal(draw(probs, sampler), first)
    torch.manual_seed(3)
    assert torch.equal(
        draw(probs, "multinomial"), torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(3)).squeeze(1)
    )
