"""Running mean and variance of a stream of values (used for reward normalisation and scaling).

Paper section 5.3.1 normalises reward-model scores with their *historical* mean and standard
deviation rather than per-batch ones, so a batch of uniformly good answers is not pushed to
zero. The statistics here are exact: after any sequence of ``update`` calls they equal
``numpy.mean`` / ``numpy.var`` (population variance, ddof=0) of everything seen, because
batches are combined with the parallel merge of Chan, Golub and LeVeque (1979).

With several data-parallel ranks (rlhf_core/distributed) ``update`` is a collective: every rank
gathers every rank's batch moments and merges them in rank order, so all ranks hold the statistics
of the GLOBAL rollout batch, the same as one process that saw all of it.
"""

import math

import torch
from torch import Tensor

from rlhf_core.distributed.collectives import gather_moments


def tensor_moments(x: Tensor) -> tuple[int, float, float]:
    """``(count, mean, population variance)`` of all entries of ``x``, computed in float64.

    This is what one data-parallel rank sends to the others: every rank all-gathers these
    triples and merges them in rank order, so all ranks end with identical statistics.
    """
    if x.numel() == 0:
        raise ValueError("cannot compute moments of an empty tensor")
    values = x.detach().to(device="cpu", dtype=torch.float64).flatten()
    mean = values.mean()
    var = (values - mean).square().mean()
    return values.numel(), float(mean), float(var)


class RunningMeanStd:
    """Count, mean and population variance of every value seen so far.

    ``std`` adds ``eps`` to the variance so that dividing by it is safe while the variance is
    still 0 (for example after a single value).
    """

    def __init__(self, eps: float = 1e-8) -> None:
        self.eps = eps
        self.count = 0
        self.mean = 0.0
        self.var = 0.0

    @property
    def std(self) -> float:
        """``sqrt(var + eps)``, the scale used to normalise or scale scores."""
        return math.sqrt(self.var + self.eps)

    def update(self, x: Tensor) -> None:
        """Fold every entry of ``x`` (any shape, e.g. scores ``[B]``) into the statistics.

        Every rank must call it (one process: just this ``x``); all ranks' entries are folded in.
        """
        for moments in gather_moments(tensor_moments(x)):
            self.merge(*moments)

    def merge(self, count: int, mean: float, var: float) -> None:
        """Combine with the statistics ``(count, mean, population var)`` of other values.

        Chan et al.'s pairwise formula: the combined sum of squared deviations is the two
        parts' sums plus ``delta**2 * n_a * n_b / n`` for the shift between their means.
        """
        if count < 0 or var < 0:
            raise ValueError(f"merge needs count >= 0 and var >= 0, got count={count}, var={var}")
        if count == 0:
            return
        total = self.count + count
        delta = mean - self.mean
        sum_sq = self.var * self.count + var * count + delta * delta * self.count * count / total
        self.mean = self.mean + delta * count / total
        self.var = sum_sq / total
        self.count = total

    def state_dict(self) -> dict[str, float]:
        """Plain numbers only, so the statistics can be checkpointed as JSON."""
        return {"count": self.count, "mean": self.mean, "var": self.var}

    def load_state_dict(self, state: dict[str, float]) -> None:
        """Restore what ``state_dict`` returned; rejects missing/unknown keys and bad values."""
        expected = {"count", "mean", "var"}
        if set(state) != expected:
            raise ValueError(f"RunningMeanStd state must have keys {sorted(expected)}, got {sorted(state)}")
        count, mean, var = state["count"], float(state["mean"]), float(state["var"])
        if count != int(count) or count < 0 or var < 0:
            raise ValueError(f"invalid RunningMeanStd state: count={count}, var={var}")
        self.count, self.mean, self.var = int(count), mean, var
