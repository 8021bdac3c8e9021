"""Phase 3 of an iteration: learn from one `Experience` (paper 5.1, with the 5.3 tricks of `recipe.py`).

`ppo_epochs` passes over the experience in shuffled mini-batches of `mini_batch_size`, each one optimizer
step accumulated over micro-batches of `micro_batch_size`. The advantages are whitened and clipped over
the whole rollout batch first (`recipe.loss_advantages`); every loss is a token sum divided by the
MINI-batch's token count (of all ranks), so the split into micro-batches and ranks does not change the
update. The gradients go to a `learner.Learner`, which clips each model's norm and steps. This module is
where a NaN or infinite loss or gradient norm is refused (`_refuse_non_finite`): the accumulated
gradients are dropped and `CollapseError` ("finite") stops the run before the optimizer steps.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import replace

import torch
from torch import Tensor, nn

from rlhf_core.config import PPOConfig
from rlhf_core.distributed.collectives import sum_counts, sum_metrics
from rlhf_core.models.heads import Critic
from rlhf_core.ppo.experience import Experience
from rlhf_core.ppo.guard import check_finite
from rlhf_core.ppo.learner import Learner, ModelName
from rlhf_core.ppo.monitors import Metrics
from rlhf_core.ppo.ptx import PtxBatch, PtxStream, ptx_nll_sum
from rlhf_core.ppo.recipe import loss_advantages, policy_objective, policy_terms, value_terms
from rlhf_core.ppo.scoring import chunks, response_logprobs, response_values
from rlhf_core.ppo.sequences import TrunkStates

TrunkLookup = Callable[[Experience, str], TrunkStates | None]


def average(updates: list[Metrics]) -> Metrics:
    """Mean of each metric over the optimizer steps of one iteration."""
    totals: dict[str, float] = defaultdict(float)
    for update in updates:
        for name, value in update.items():
            totals[name] += value
    return {name: value / len(updates) for name, value in totals.items()}


class PPOUpdate:
    """The losses of one iteration's optimizer steps; `learner` applies them.

    `trunk_of(experience, model)` gives the shared trunk's states of the experience's rows for `model`
    (None: a full forward), `autocast()` the precision context of the forward passes.
    """

    def __init__(
        self,
        trainable: nn.ModuleDict,
        config: PPOConfig,
        learner: Learner,
        ptx: PtxStream | None,
        trunk_of: TrunkLookup,
        autocast: Callable[[], AbstractContextManager[object]],
    ) -> None:
        self.trainable = trainable
        self.policy = trainable["policy"]
        self.critic: Critic = trainable["critic"]
        self.config = config
        self.learner = learner
        self.ptx = ptx
        self.trunk_of = trunk_of
        self.autocast = autocast

    def learn(self, experience: Experience, train_policy: bool, step: int) -> Metrics:
        """`ppo_epochs` shuffled passes of mini-batch updates; returns their mean metrics."""
        started = time.perf_counter()
        size = self.config.mini_batch_size
        experience = replace(
            experience, advantages=loss_advantages(experience.advantages, experience.response_mask, self.config)
        )
        device = experience.response_ids.device
        updates = []
        for _ in range(self.config.ppo_epochs):
            order = torch.randperm(experience.batch_size, device=device)
            for first in range(0, experience.batch_size, size):
                batch = experience.select(order[first : first + size])
                updates.append(self.update_minibatch(batch, train_policy, step))
        return {**average(updates), "time/train_s": time.perf_counter() - started}

    def update_minibatch(self, batch: Experience, train_policy: bool, step: int) -> Metrics:
        """One optimizer step on one mini-batch, accumulated over its micro-batches.

        Raises `CollapseError` ("finite") before the optimizer steps if a loss or gradient norm is
        NaN or infinite, so no bad update is ever applied (`_refuse_non_finite`).
        """
        num_tokens = sum_counts({"tokens": int(batch.response_mask.sum())})["tokens"]  # of all ranks
        ptx_batches = self.ptx.next_batches() if train_policy and self.ptx is not None else []
        local_ptx_tokens = sum(int(ptx.loss_mask[:, 1:].sum()) for ptx in ptx_batches)
        ptx_tokens = sum_counts({"tokens": local_ptx_tokens})["tokens"]
        self.trainable.train()
        metrics: dict[str, float] = defaultdict(float)
        rows_of = torch.arange(batch.batch_size, device=batch.response_ids.device)
        for index, rows in enumerate(chunks(batch.batch_size, self.config.micro_batch_size)):
            micro = batch.select(rows_of[rows])
            self._critic_backward(micro, num_tokens, step, metrics)
            if train_policy:
                ptx = (ptx_batches[index], ptx_tokens) if ptx_batches else None
                self._policy_backward(micro, num_tokens, ptx, step, metrics)
        norms = self.learner.clip_gradients(train_policy)
        for name, norm in norms.items():
            self._refuse_non_finite(name, norm, step)
        self.learner.apply_gradients()
        return {**sum_metrics(dict(metrics)), **norms}  # each rank's share of the global mini-batch

    def _critic_backward(self, micro: Experience, num_tokens: int, step: int, metrics: dict[str, float]) -> None:
        """Value loss of one micro-batch (normalised by the mini-batch's `num_tokens`) and its gradient."""
        with self.autocast():
            values = response_values(
                self.critic,
                micro.prompt_ids,
                micro.prompt_mask,
                micro.response_ids,
                micro.response_mask,
                trunk=self.trunk_of(micro, "critic"),
            )
            loss, stats = value_terms(values, micro, self.config, num_tokens)
        self._backward("critic", "loss/value", loss, step, metrics)
        share = int(micro.response_mask.sum()) / num_tokens  # weights this micro-batch's mean statistics
        metrics["value/clip_fraction"] += share * float(stats.clip_fraction)

    def _policy_backward(
        self, micro: Experience, num_tokens: int, ptx: tuple[PtxBatch, int] | None, step: int, metrics: dict[str, float]
    ) -> None:
        """Policy objective of one micro-batch (with its PPO-ptx micro-batch and the mini-batch's PPO-ptx
        token count, if any) and its gradient."""
        config = self.config
        with self.autocast():
            logprobs, entropy = response_logprobs(
                self.policy,
                micro.prompt_ids,
                micro.prompt_mask,
                micro.response_ids,
                micro.response_mask,
                config.rollout.temperature,
                with_entropy=config.entropy_coef > 0,
                trunk=self.trunk_of(micro, "policy"),
            )
            entropy = entropy if entropy is not None else torch.zeros_like(logprobs)
            surrogate, mean_entropy, stats = policy_terms(
                logprobs, entropy, micro, micro.advantages, config, num_tokens
            )
            ptx_loss = ptx_nll_sum(self.policy, ptx[0]) / ptx[1] if ptx else surrogate.new_zeros(())
        objective = policy_objective(surrogate, mean_entropy, ptx_loss, config)
        self._backward("policy", "loss/policy_total", objective, step, metrics)
        share = int(micro.response_mask.sum()) / num_tokens
        metrics["loss/policy"] += surrogate.item()
        metrics["loss/entropy"] += mean_entropy.item()
        metrics["loss/ptx"] += ptx_loss.item()
        metrics["policy/clip_fraction"] += share * float(stats.clip_fraction)
        metrics["policy/approx_kl"] += share * float(stats.approx_kl)
        metrics["policy/ratio_mean"] += share * float(stats.ratio_mean)

    def _backward(self, model: ModelName, name: str, loss: Tensor, step: int, metrics: dict[str, float]) -> None:
        """Check the loss is finite, add it to `metrics[name]` and accumulate `model`'s gradient."""
        value = loss.item()
        self._refuse_non_finite(name, value, step)
        metrics[name] += value
        self.learner.backward(model, loss)

    def _refuse_non_finite(self, name: str, value: float, step: int) -> None:
        """A NaN or infinite loss or gradient norm: drop every accumulated gradient and raise
        `CollapseError` ("finite"), so nothing of this step is applied."""
        if not math.isfinite(value):
            self.learner.discard_gradients()
        check_finite(name, value, step)
