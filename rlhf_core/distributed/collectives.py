"""Sums across ranks of what a loss or a statistic needs from the whole global batch.

Every helper is a collective: all ranks must call it, in the same order. With one rank (no process
group) each returns its input's value, so callers never branch on the world size. Sums are taken in
float64 (counts in int64) on the communication device (CUDA for NCCL, CPU for gloo).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor

Moments = tuple[int, float, float]
T = TypeVar("T")


def group_size() -> int:
    """Ranks in the process group; 1 when there is none."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return 1


def computed_on_main(compute: Callable[[], T]) -> T:
    """`compute()` run by rank 0 alone, its result (or its error, raised on every rank) sent to all ranks.

    For work whose answer every rank needs but one rank can find, such as hashing input files.
    """
    if group_size() == 1:
        return compute()
    holder: list[object] = [None]
    if torch.distributed.get_rank() == 0:
        try:
            holder[0] = compute()
        except Exception as error:  # every rank raises it, none waits for a result that never comes
            holder[0] = error
    torch.distributed.broadcast_object_list(holder, src=0)
    if isinstance(holder[0], Exception):
        raise holder[0]
    return holder[0]  # type: ignore[return-value]


def _comm_device() -> torch.device:
    """NCCL only moves CUDA tensors; gloo moves CPU tensors."""
    if torch.distributed.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def sum_across_ranks(values: Tensor) -> Tensor:
    """The elementwise sum of `values` over all ranks, as a float64 (or int64 for integers) CPU tensor."""
    dtype = torch.int64 if not values.is_floating_point() else torch.float64
    total = values.detach().to(dtype=dtype)
    if group_size() == 1:
        return total.cpu()
    total = total.to(_comm_device())
    torch.distributed.all_reduce(total, op=torch.distributed.ReduceOp.SUM)
    return total.cpu()


def sum_counts(counts: dict[str, int]) -> dict[str, int]:
    """Unit counts (tokens, pairs) summed over ranks; the keys must be the same, in the same order."""
    summed = sum_across_ranks(torch.tensor(list(counts.values()), dtype=torch.int64))
    return {name: int(value) for name, value in zip(counts, summed.tolist())}


def sum_metrics(metrics: dict[str, float]) -> dict[str, float]:
    """Float metrics summed over ranks (e.g. per-rank shares of a step's loss); same keys on every rank."""
    if not metrics:
        return {}
    summed = sum_across_ranks(torch.tensor(list(metrics.values()), dtype=torch.float64))
    return dict(zip(metrics, summed.tolist()))


def gather_moments(moments: Moments) -> list[Moments]:
    """Every rank's `(count, mean, population variance)`, in rank order (the same list on every rank).

    Merging these in order (Chan et al.'s parallel formula) gives the statistics of the union of the
    ranks' values: what running reward normalisation folds in per rollout.
    """
    if group_size() == 1:
        return [moments]
    local = torch.tensor([float(value) for value in moments], dtype=torch.float64, device=_comm_device())
    parts = [torch.empty_like(local) for _ in range(group_size())]
    torch.distributed.all_gather(parts, local)
    return [(int(part[0].item()), float(part[1].item()), float(part[2].item())) for part in parts]


def global_masked_mean_var(x: Tensor, mask: Tensor, unbiased: bool = True) -> tuple[Tensor, Tensor]:
    """Mean and variance of the real (mask != 0) entries of `x` over ALL ranks, as 0-d tensors of x's dtype.

    Two passes, as `rlhf_core.ppo.masked` does on one rank: the global count and sum give the mean,
    then the global sum of squared deviations from it gives the variance (divided by count - 1 when
    `unbiased`). Advantage whitening uses it so the mini-batch it whitens over is the global one.
    """
    real = mask.bool()
    values = x[real].to(torch.float64)
    count_and_sum = sum_across_ranks(torch.stack([values.new_tensor(values.numel()), values.sum()]))
    count = int(count_and_sum[0].item())
    needed = 2 if unbiased else 1
    if count < needed:
        raise ValueError(f"global masked variance needs at least {needed} real entries, got {count}")
    mean = count_and_sum[1] / count
    squares = sum_across_ranks((values - mean.to(values.device)).square().sum())
    var = squares / (count - 1 if unbiased else count)
    return mean.to(x.dtype).to(x.device), var.to(x.dtype).to(x.device)


def gather_rows(x: Tensor, fill: float = 0, pad_left: bool = False) -> Tensor:
    """Every rank's rows of `x` (``[B_r]`` or ``[B_r, W_r]``), concatenated in rank order, on x's device.

    2-d tensors are padded with `fill` to the widest rank's width, on the right (`pad_left`: on the
    left, for left-padded prompts). The PPO trainer gathers a rollout's experience this way so that its
    monitors (and the collapse guard reading them) describe the global batch on every rank.
    """
    if group_size() == 1:
        return x
    if x.dim() not in (1, 2):
        raise ValueError(f"gather_rows takes [B] or [B, W] tensors, got shape {tuple(x.shape)}")
    device, dtype = _comm_device(), x.dtype
    shape = torch.tensor([x.shape[0], x.shape[1] if x.dim() == 2 else 0], device=device)
    shapes = [torch.empty_like(shape) for _ in range(group_size())]
    torch.distributed.all_gather(shapes, shape)
    rows = [int(part[0]) for part in shapes]
    width = max(int(part[1]) for part in shapes)
    payload = x.to(device=device, dtype=torch.int64 if dtype == torch.bool else dtype)
    if x.dim() == 2:
        padding = width - x.shape[1]
        payload = F.pad(payload, (padding, 0) if pad_left else (0, padding), value=fill)
    payload = F.pad(payload, (0, 0) * (x.dim() - 1) + (0, max(rows) - x.shape[0]), value=fill)
    parts = [torch.empty_like(payload) for _ in range(group_size())]
    torch.distributed.all_gather(parts, payload)
    return torch.cat([part[:count] for part, count in zip(parts, rows)]).to(device=x.device, dtype=dtype)
