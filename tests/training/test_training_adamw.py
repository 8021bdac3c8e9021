"""The AdamW every single-process stage trains with (rlhf_core/training/update.py `adamw`): torch's
fused kernel where the parameters allow it, checked against AdamW written out by hand."""

import copy
import math

import pytest
import torch
from torch import nn

from rlhf_core.config import PPOConfig
from rlhf_core.ppo.learner import build_ppo_optimizer
from rlhf_core.training.update import adamw, build_adamw

LR, BETAS, EPS, DECAY = 1e-2, (0.9, 0.999), 1e-8, 0.1


def reference_adamw(
    weights: torch.Tensor,
    gradients: list[torch.Tensor],
    lr: float,
    betas: tuple[float, float],
    eps: float,
    decay: float,
) -> torch.Tensor:
    """Loshchilov & Hutter's AdamW as torch documents it, one step per gradient, in float64."""
    p, m, v = (
        weights.double().clone(),
        torch.zeros_like(weights, dtype=torch.float64),
        torch.zeros_like(weights, dtype=torch.float64),
    )
    for step, grad in enumerate(gradients, start=1):
        g = grad.double()
        p = p * (1 - lr * decay)
        m = betas[0] * m + (1 - betas[0]) * g
        v = betas[1] * v + (1 - betas[1]) * g * g
        m_hat, v_hat = m / (1 - betas[0] ** step), v / (1 - betas[1] ** step)
        p = p - lr * m_hat / (v_hat.sqrt() + eps)
    return p


def test_cpu_parameters_get_the_fused_kernel_and_its_steps_equal_adamw_written_out() -> None:
    generator = torch.Generator().manual_seed(0)
    start = torch.randn(64, 32, generator=generator)
    gradients = [torch.randn(64, 32, generator=generator) for _ in range(30)]
    weight = nn.Parameter(start.clone())
    optimizer = adamw([{"params": [weight], "weight_decay": DECAY}], lr=LR, betas=BETAS, eps=EPS)
    assert optimizer.defaults["fused"] is True
    for grad in gradients:
        weight.grad = grad.clone()
        optimizer.step()
    expected = reference_adamw(start, gradients, LR, BETAS, EPS, DECAY)
    torch.testing.assert_close(weight.detach().double(), expected, rtol=0, atol=1e-5)
    assert not torch.equal(weight.detach(), start)


def test_the_stage_optimizers_are_fused_and_keep_their_groups() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    optimizer = build_adamw(model, lr=LR, weight_decay=DECAY, betas=BETAS, eps=EPS)
    assert optimizer.defaults["fused"] is True
    assert [group["weight_decay"] for group in optimizer.param_groups] == [DECAY, 0.0]  # matrices, then 1-d
    ppo = build_ppo_optimizer(nn.Linear(4, 4), nn.Linear(4, 1), PPOConfig(policy_lr=1e-6, critic_lr=5e-6))
    assert ppo.defaults["fused"] is True
    assert [(group["name"], group["lr"]) for group in ppo.param_groups] == [("policy", 1e-6), ("critic", 5e-6)]


def test_a_checkpoint_of_the_unfused_optimizer_resumes_with_the_same_steps() -> None:
    """Checkpoints written before the fused kernel: loading one keeps its update (the saved flag wins)."""
    generator = torch.Generator().manual_seed(1)
    gradients = [torch.randn(8, generator=generator) for _ in range(6)]
    weights = {name: nn.Parameter(torch.ones(8)) for name in ("unfused", "resumed")}
    unfused = torch.optim.AdamW([weights["unfused"]], lr=LR)
    for grad in gradients[:3]:
        weights["unfused"].grad = grad.clone()
        unfused.step()
    weights["resumed"].data.copy_(weights["unfused"].data)
    resumed = adamw([{"params": [weights["resumed"]]}], lr=LR)
    resumed.load_state_dict(copy.deepcopy(unfused.state_dict()))  # as read back from a checkpoint file
    assert not resumed.param_groups[0]["fused"]
    for grad in gradients[3:]:
        for name, optimizer in (("unfused", unfused), ("resumed", resumed)):
            weights[name].grad = grad.clone()
            optimizer.step()
    assert torch.equal(weights["resumed"].detach(), weights["unfused"].detach())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_steps_stay_finite_in_the_training_dtypes(dtype: torch.dtype) -> None:
    weight = nn.Parameter(torch.ones(16, dtype=dtype))
    optimizer = adamw([{"params": [weight]}], lr=LR)
    weight.grad = torch.full_like(weight, 0.5)
    optimizer.step()
    assert all(math.isfinite(float(x)) for x in weight.detach().float()) and float(weight[0]) < 1.0
