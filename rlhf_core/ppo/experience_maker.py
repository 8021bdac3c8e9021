"""Phase 1 of an iteration: sample responses and judge them into an `Experience` (paper 5.1, Figure 1).

The `ExperienceMaker` owns everything between the prompt stream and the tensors PPO learns from: the
next prompts (a seeded reshuffle every epoch, sharded across ranks), one batched call of the rollout
engine (rlhf_core/rollout/engine.py, `ppo.rollout.engine`; under ZeRO-3 with the policy gathered once), and the
no-grad scoring passes of the policy, the reference, the critic and the reward model, `scoring_rows`
rows at a time: the log-probs PPO uses are always the scoring pass's, never the engine's. With the
shared trunk (rlhf_core/ppo/shared_trunk.py) the frozen lower blocks run once per rollout (or not at all:
the lean engine hands back their states) and every pass, the update included, starts from their
residual stream. `recipe.assemble_experience` then turns the scores into
rewards, advantages and returns. Validation (validation.py) samples and scores through the same methods.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from rlhf_core.config import PPOConfig
from rlhf_core.distributed.collectives import gather_rows, group_size, sum_across_ranks
from rlhf_core.distributed.context import RankContext
from rlhf_core.distributed.sharding import shard
from rlhf_core.models.chat import Messages, encode_prompt
from rlhf_core.models.heads import Critic
from rlhf_core.ppo.experience import Experience
from rlhf_core.ppo.losses import at_least_float32
from rlhf_core.ppo.monitors import Metrics, experience_monitors
from rlhf_core.ppo.normalizers import RunningMeanStd
from rlhf_core.ppo.recipe import assemble_experience
from rlhf_core.ppo.scoring import RewardModelScorer, Scorer, chunks, response_logprobs, response_values
from rlhf_core.ppo.sequences import TrunkStates
from rlhf_core.ppo.shared_trunk import SharedTrunk, find_shared_trunk, share_storage
from rlhf_core.rollout.engine import Generation, RolloutEngine, SamplingParams
from rlhf_core.rollout.engines import make_rollout_engine
from rlhf_core.rollout.generation import left_pad, stop_token_ids
from rlhf_core.training.batching import BatchPlan, fixed_size_plan

log = logging.getLogger(__name__)
Batch = tuple[Tensor, Tensor]  # ids and mask: a prompt ``[B, P]`` (left-padded) or response ``[B, T]``


@dataclass
class PPOModels:
    """The four models of PPO (paper 5.1): two trained, two frozen."""

    policy: PreTrainedModel  # trained; starts as the SFT model
    reference: PreTrainedModel  # frozen copy of the SFT model: the KL anchor
    critic: Critic  # trained; starts from the reward model (or SFT + a fresh head)
    scorer: Scorer  # frozen reward model (`scoring.RewardModelScorer`) or, in tests, a rule


def engine_logprob_gap(generation: Generation, scoring_logprobs: Tensor) -> Metrics:
    """How far the engine's own log-probs of its tokens are from the scoring pass's (none reported: {}).

    With float32 weights both are the policy's distribution up to rounding; a larger gap (bf16 weights)
    is how far off-policy the rollout is (lean_engine.py)."""
    real = generation.response_mask.bool()
    if generation.logprobs is None or not bool(real.any()):
        return {}
    gap = (generation.logprobs - scoring_logprobs).abs()[real]
    return {"rollout/engine_logprob_gap": float(gap.mean()), "rollout/engine_logprob_gap_max": float(gap.max())}


def gather_experience(experience: Experience, pad_id: int) -> Experience:
    """The rollout of all ranks, rows in rank order (one process: `experience` itself; a collective).

    Prompts stay left-padded and responses right-padded (with the pad id; other fields with 0), so the
    result is a valid `Experience`: what the monitors and the collapse guard read, identical on every rank.
    """
    if group_size() == 1:
        return experience
    return Experience(
        prompt_ids=gather_rows(experience.prompt_ids, fill=pad_id, pad_left=True),
        prompt_mask=gather_rows(experience.prompt_mask, pad_left=True),
        response_ids=gather_rows(experience.response_ids, fill=pad_id),
        response_mask=gather_rows(experience.response_mask),
        finished=gather_rows(experience.finished),
        logprobs=gather_rows(experience.logprobs),
        ref_logprobs=gather_rows(experience.ref_logprobs),
        entropy=gather_rows(experience.entropy),
        values=gather_rows(experience.values),
        scores=gather_rows(experience.scores),
        processed_scores=gather_rows(experience.processed_scores),
        kl=gather_rows(experience.kl),
        rewards=gather_rows(experience.rewards),
        advantages=gather_rows(experience.advantages),
        returns=gather_rows(experience.returns),
    )


class ExperienceMaker:
    """Prompt stream, sampling and scoring; its state (`prompt_batches_used`, `score_stats`) is checkpointed.

    `whole_policy()` is the context that makes the policy's weights whole for sampling (ZeRO-3), and
    `autocast()` the precision of every forward pass; the trainer provides both. `engine` samples the
    replies (default: the one `ppo.rollout.engine` names, made on first use, inside `whole_policy()`).
    """

    def __init__(
        self,
        models: PPOModels,
        tokenizer: PreTrainedTokenizerBase,
        prompts: Sequence[Messages],
        config: PPOConfig,
        seed: int,
        context: RankContext,
        whole_policy: Callable[[], AbstractContextManager[None]],
        autocast: Callable[[], AbstractContextManager[object]],
        engine: RolloutEngine | None = None,
    ) -> None:
        self.models = models
        self.engine = engine
        self.tokenizer = tokenizer
        self.prompts = prompts
        self.config = config
        self.context = context
        self.whole_policy = whole_policy
        self.autocast = autocast
        self.device = next(models.policy.parameters()).device
        self.pad_id = tokenizer.pad_token_id
        self.stop_ids = stop_token_ids(tokenizer)
        self.trunk = self._shared_trunk()
        self.prompt_plan = self._prompt_plan(seed)
        self.prompt_batches_used = 0
        self.score_stats = RunningMeanStd()

    def _prompt_plan(self, seed: int) -> BatchPlan:
        """The global prompt stream: `rollout_batch_size` prompts per rank and iteration."""
        global_batch = self.config.rollout_batch_size * self.context.world_size
        if len(self.prompts) < global_batch:
            raise ValueError(
                f"PPO needs at least rollout_batch_size={self.config.rollout_batch_size} training prompts "
                f"per rank ({self.context.world_size} ranks), got {len(self.prompts)}"
            )
        return fixed_size_plan(len(self.prompts), seed, global_batch, 1)

    def _shared_trunk(self) -> SharedTrunk | None:
        """The frozen lower blocks the models share (shared_trunk.py), when switched on and found; the
        frozen members (reference, reward model) are made to store them once (`share_storage`)."""
        if not self.config.share_frozen_trunk or self.context.is_distributed:
            return None
        scorer = self.models.scorer
        trunk = find_shared_trunk(
            self.models.policy,
            {
                "reference": self.models.reference.base_model,
                "critic": self.models.critic.backbone,
                "reward_model": scorer.reward_model.backbone if isinstance(scorer, RewardModelScorer) else None,
            },
            self.config.trainable_top_layers,
        )
        if trunk is not None:
            frozen = {"reference": (self.models.reference.base_model, self.models.reference)}
            if isinstance(scorer, RewardModelScorer):
                frozen["reward_model"] = (scorer.reward_model.backbone, scorer.reward_model)
            log.info(
                "shared trunk: the lower %d blocks of the policy, shared with %s (%.0f MiB stored once)",
                trunk.num_lower,
                ", ".join(sorted(trunk.members)),
                share_storage(trunk, frozen) / 2**20,
            )
        return trunk

    # ---- the shared trunk ------------------------------------------------------------------------

    @torch.no_grad()
    def trunk_states(self, prompt: Batch, response: Batch, generation: Generation | None = None) -> TrunkStates | None:
        """The shared trunk's residual stream of a sampled batch (None without a shared trunk): the one the
        engine computed while sampling `generation` when it did (`Generation.trunk_residual`), else a pass."""
        if self.trunk is None:
            return None
        if generation is not None and generation.trunk_residual is not None:
            return TrunkStates(generation.trunk_residual, self.trunk.num_lower)
        with self.autocast():
            return self.trunk.states(prompt, response, self.config.scoring_rows)

    def trunk_for(self, model: str, states: TrunkStates | None) -> TrunkStates | None:
        """`states` when `model` starts its passes from the shared trunk, else None (a full forward)."""
        if states is None or self.trunk is None or not self.trunk.serves(model):
            return None
        return states

    def experience_trunk(self, experience: Experience, model: str) -> TrunkStates | None:
        """The rollout's shared-trunk states of `experience`'s rows, for `model`'s update pass."""
        if experience.trunk_residual is None or self.trunk is None:
            return None
        return self.trunk_for(model, TrunkStates(experience.trunk_residual, self.trunk.num_lower))

    # ---- sampling and scoring --------------------------------------------------------------------

    def next_prompts(self) -> list[list[int]]:
        """Token ids of the next rollout batch of the prompt stream (a seeded reshuffle each epoch).

        Sorted by length, so the micro-batches of the scoring passes need little padding.
        """
        (rows,) = self.prompt_plan.step(self.prompt_batches_used)
        rows = shard(rows, self.context)
        self.prompt_batches_used += 1
        log.debug(  # the distributed tests read these lines: each rank's shard of each step
            "rank %d of %d, step %d: prompts %s",
            self.context.rank,
            self.context.world_size,
            self.prompt_batches_used,
            rows,
        )
        prompts = [encode_prompt(self.tokenizer, self.prompts[i], self.config.max_prompt_tokens) for i in rows]
        return sorted(prompts, key=len)

    @torch.no_grad()
    def generate(self, prompt: Batch) -> Generation:
        """One response per prompt from the policy as it is now (the engine synced to it first)."""
        self.models.policy.eval()
        params = SamplingParams(self.config.rollout, tuple(self.stop_ids), self.pad_id)
        with self.whole_policy(), self.autocast():
            if self.engine is None:
                trunk_layers = self.trunk.num_lower if self.trunk is not None else None
                rows = prompt[0].shape[0]
                self.engine = make_rollout_engine(self.config.rollout, self.models.policy, rows, trunk_layers)
            self.engine.sync_weights(self.models.policy)
            return self.engine.generate(*prompt, params)

    def sample(self, prompt: Batch) -> tuple[Tensor, Tensor, Tensor]:
        """One response per prompt from the policy: ids, mask ``[B, T]`` and finished ``[B]``."""
        generation = self.generate(prompt)
        return generation.response_ids, generation.response_mask, generation.finished

    def _per_micro_batch(
        self, pass_: Callable[..., Any], prompt: Batch, response: Batch, trunk: TrunkStates | None
    ) -> list[Any]:
        """`pass_(prompt_ids, prompt_mask, response_ids, response_mask, trunk=...)` on each micro-batch of
        rows, in order: the one loop every scoring pass runs."""
        parts = []
        for rows in chunks(prompt[0].shape[0], self.config.scoring_rows):
            with self.autocast():
                parts.append(
                    pass_(
                        prompt[0][rows],
                        prompt[1][rows],
                        response[0][rows],
                        response[1][rows],
                        trunk=trunk.select(rows) if trunk is not None else None,
                    )
                )
        return parts

    @torch.no_grad()
    def logprobs(self, model: PreTrainedModel, prompt: Batch, response: Batch, trunk: TrunkStates | None) -> Tensor:
        """Log-probs ``[B, T]`` of the responses under `model` at the sampling temperature."""

        def pass_(*batch: Tensor, trunk: TrunkStates | None) -> Tensor:
            return response_logprobs(model, *batch, self.config.rollout.temperature, trunk=trunk)[0]

        return torch.cat(self._per_micro_batch(pass_, prompt, response, trunk))

    @torch.no_grad()
    def policy_logprobs_and_entropy(
        self, prompt: Batch, response: Batch, trunk: TrunkStates | None
    ) -> tuple[Tensor, Tensor]:
        """The rollout policy's log-probs and entropy ``[B, T]``."""

        def pass_(*batch: Tensor, trunk: TrunkStates | None) -> tuple[Tensor, Tensor | None]:
            return response_logprobs(
                self.models.policy, *batch, self.config.rollout.temperature, with_entropy=True, trunk=trunk
            )

        parts = self._per_micro_batch(pass_, prompt, response, trunk)
        return torch.cat([logprobs for logprobs, _ in parts]), torch.cat([entropy for _, entropy in parts])

    @torch.no_grad()
    def values(self, prompt: Batch, response: Batch, trunk: TrunkStates | None) -> Tensor:
        """Critic values ``[B, T]`` of the rollout."""

        def pass_(*batch: Tensor, trunk: TrunkStates | None) -> Tensor:
            return response_values(self.models.critic, *batch, trunk=trunk)

        return torch.cat(self._per_micro_batch(pass_, prompt, response, trunk))

    @torch.no_grad()
    def scores(self, prompt: Batch, response: Batch, trunk: TrunkStates | None) -> Tensor:
        """The scorer's raw scores ``[B]`` (the reward model's upper blocks only, with `trunk`)."""
        scorer = self.models.scorer
        if trunk is not None and isinstance(scorer, RewardModelScorer):
            with self.autocast():
                return at_least_float32(scorer.score(*prompt, *response, trunk=trunk))
        return at_least_float32(scorer(*prompt, *response))

    # ---- one rollout -----------------------------------------------------------------------------

    @torch.no_grad()
    def make_experience(self, prompts: list[list[int]]) -> tuple[Experience, Metrics]:
        """Sample, judge and assemble one `Experience`; also returns the phase timings and token count.

        Updates the running score statistics with this batch's raw scores (before normalising it, see
        `rewards.py`; the unfinished penalty comes after, `recipe.penalize_unfinished`).
        """
        self.models.critic.eval()
        prompt = left_pad(prompts, self.pad_id, self.device)
        started = time.perf_counter()
        generation = self.generate(prompt)
        generated = time.perf_counter()
        response_ids, response_mask, finished = generation.response_ids, generation.response_mask, generation.finished
        response = (response_ids, response_mask)
        trunk = self.trunk_states(prompt, response, generation)
        logprobs, entropy = self.policy_logprobs_and_entropy(prompt, response, trunk)
        ref_logprobs = self.logprobs(self.models.reference, prompt, response, self.trunk_for("reference", trunk))
        values = self.values(prompt, response, self.trunk_for("critic", trunk))
        scores = self.scores(prompt, response, self.trunk_for("reward_model", trunk))
        scored = time.perf_counter()
        self.score_stats.update(scores)
        experience = assemble_experience(
            prompt_ids=prompt[0],
            prompt_mask=prompt[1],
            response_ids=response_ids,
            response_mask=response_mask,
            finished=finished,
            logprobs=logprobs,
            ref_logprobs=ref_logprobs,
            entropy=entropy,
            values=values,
            scores=scores,
            score_stats=self.score_stats,
            config=self.config,
            trunk_residual=trunk.residual if trunk is not None else None,
        )
        timings = {
            "time/generate_s": generated - started,
            "time/score_s": scored - generated,
            "rollout/generated_tokens": float(sum_across_ranks(response_mask.sum())),
            "reward/running_mean": self.score_stats.mean,
            "reward/running_std": self.score_stats.std,
            **engine_logprob_gap(generation, logprobs),
        }
        return experience, timings

    def rollout(self) -> tuple[Experience, Metrics]:
        """The next prompts' experience and all its monitors (over every rank's rows)."""
        experience, metrics = self.make_experience(self.next_prompts())
        metrics.update(experience_monitors(gather_experience(experience, self.pad_id)))
        return experience, metrics

    def state_dict(self) -> dict[str, object]:
        return {"score_stats": self.score_stats.state_dict(), "prompt_batches_used": self.prompt_batches_used}

    def load_state_dict(self, state: dict[str, object]) -> None:
        self.score_stats.load_state_dict(state["score_stats"])  # type: ignore[arg-type]
        self.prompt_batches_used = int(state["prompt_batches_used"])  # type: ignore[call-overload]
