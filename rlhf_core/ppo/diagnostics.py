"""Monitoring statistics for PPO training (paper section 5.2 watches such signals for collapse)."""

import torch
from torch import Tensor

from rlhf_core.ppo.masked import masked_var


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> Tensor:
    """``1 - Var[returns - values] / Var[returns]`` over real tokens -> 0-d tensor.

    1 means the critic predicts the returns perfectly, 0 means it is no better than a constant,
    negative means worse than a constant. Shapes: all ``[B, T]``. When the returns do not vary
    at all the ratio is undefined and the result is ``nan``.
    """
    var_returns = masked_var(returns, mask)
    var_residual = masked_var(returns - values, mask)
    if var_returns == 0:
        return torch.full((), float("nan"), dtype=returns.dtype, device=returns.device)
    return 1.0 - var_residual / var_returns
