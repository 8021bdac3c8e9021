"""Reductions over the real tokens of right-padded response tensors.

Every PPO quantity lives in response space: a ``[B, T]`` tensor whose row ``b`` holds one
response, right-padded, with ``mask[b, t]`` true (non-zero) on its real tokens. Padding must
never leak into a statistic, so these helpers select entries with ``torch.where`` rather than
multiplying by the mask: a padded entry holding ``inf`` or ``nan`` then still cannot poison
the result (``0 * nan`` is ``nan``).
"""

import torch
from torch import Tensor


def _check_same_shape(x: Tensor, mask: Tensor) -> None:
    """Refuse silent broadcasting: a [B, T] mask applied to a [B, 1] tensor is a caller bug."""
    if x.shape != mask.shape:
        raise ValueError(f"x has shape {tuple(x.shape)} but mask has shape {tuple(mask.shape)}")


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of ``x`` over entries where ``mask`` is non-zero; padded entries are ignored.

    Shapes: ``x`` and ``mask`` are both ``[B, T]`` (any equal shape works). Returns a 0-d
    tensor when ``dim`` is None, else the sum over ``dim``.
    """
    _check_same_shape(x, mask)
    selected = torch.where(mask.bool(), x, 0.0)
    return selected.sum() if dim is None else selected.sum(dim)


def masked_count(mask: Tensor, dim: int | None = None) -> Tensor:
    """Number of real entries (non-zero mask entries), overall or along ``dim``."""
    real = mask.bool()
    return real.sum() if dim is None else real.sum(dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``x`` over its real entries, overall (``dim=None``) or along ``dim``.

    Like ``torch.mean`` of an empty tensor, the mean over no real entries is ``nan``: an empty
    selection is an upstream bug and ``nan`` keeps it visible in the logs.
    """
    return masked_sum(x, mask, dim) / masked_count(mask, dim).to(x.dtype)


def masked_var(x: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance of ``x`` over all its real entries (one number for the whole batch).

    ``unbiased=True`` divides by ``n - 1`` (Bessel), as the whitening of advantages in PPO
    implementations does. Raises ``ValueError`` when there are too few real entries for the
    estimate to exist, instead of returning ``inf``/``nan`` that whitening would spread.
    """
    count = int(masked_count(mask).item())
    needed = 2 if unbiased else 1
    if count < needed:
        raise ValueError(f"masked_var needs at least {needed} real entries (unbiased={unbiased}), mask has {count}")
    centered = x - masked_mean(x, mask)
    sum_of_squares = masked_sum(centered.square(), mask)
    return sum_of_squares / (count - 1 if unbiased else count)


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """Standardise ``x`` with the mean and (unbiased) variance of its real entries.

    Returns ``(x - mean) / sqrt(var + eps)`` on real entries and 0 on padding. With
    ``shift_mean=False`` the mean is added back, so only the scale changes: useful when the sign
    of the quantity carries meaning. Shapes: ``x`` and ``mask`` ``[B, T]`` -> ``[B, T]``.
    """
    mean = masked_mean(x, mask)
    var = masked_var(x, mask, unbiased=True)
    whitened = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask.bool(), whitened, 0.0)


def masked_max(x: Tensor, mask: Tensor) -> Tensor:
    """Largest real entry of ``x`` (0-d tensor); ``-inf`` when there is none."""
    _check_same_shape(x, mask)
    return torch.where(mask.bool(), x, float("-inf")).max()


def masked_min(x: Tensor, mask: Tensor) -> Tensor:
    """Smallest real entry of ``x`` (0-d tensor); ``inf`` when there is none."""
    _check_same_shape(x, mask)
    return torch.where(mask.bool(), x, float("inf")).min()


def check_right_padded(mask: Tensor) -> None:
    """Raise ``ValueError`` unless ``mask`` is ``[B, T]`` with each row's real tokens a prefix.

    Code that walks a response in time order (GAE, "the last real token") relies on this; a
    left-padded or holed mask would otherwise give silently wrong numbers.
    """
    if mask.dim() != 2:
        raise ValueError(f"mask must be [B, T], got shape {tuple(mask.shape)}")
    real = mask.bool()
    if bool((real[:, 1:] & ~real[:, :-1]).any()):
        raise ValueError("mask is not right-padded: a real token follows a padded position")


def last_token_index(mask: Tensor) -> Tensor:
    """Index of each row's last real token, for a right-padded ``[B, T]`` mask -> ``[B]`` long.

    The reward model scores a whole response, and that score belongs to the step that ended
    it. Raises ``ValueError`` when a row is empty or the mask is not right-padded, because then
    "the last real token" would silently be the wrong position.
    """
    check_right_padded(mask)
    lengths = mask.bool().sum(dim=1)
    if bool((lengths == 0).any()):
        empty_rows = torch.nonzero(lengths == 0).flatten().tolist()
        raise ValueError(f"mask rows {empty_rows} have no real tokens")
    return lengths - 1


def reply_tokens(response_mask: Tensor, finished: Tensor) -> Tensor:
    """The length ``[B]`` of each reply as evaluation counts it, from the response mask ``[B, T]`` and the
    ``[B]`` finished flags: its real tokens less the end-of-turn token that ends a finished reply."""
    return response_mask.sum(dim=1) - finished.long()
