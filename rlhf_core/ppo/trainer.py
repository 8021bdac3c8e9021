"""PPO-max training (paper section 5): the pure functions of `rlhf_core.ppo` composed into iterations.

One iteration (`fit` runs `critic_pretrain_steps + steps` of them):

1. rollout (`PPOTrainer.rollout`): the next `rollout_batch_size` prompts of the prompt stream, one
   sampled response each, judged under no_grad (policy and reference log-probs, critic values,
   scores) -> one `Experience`: scores get the unfinished-response penalty, are normalised or
   scaled with running statistics and clipped (5.3.1), the token-level KL penalty makes per-token
   rewards (5.3.2) and GAE gives advantages and returns (3.2);
2. guard (`guard.CollapseGuard`): the rollout's monitors against the collapse bounds (5.2);
3. update (`PPOTrainer.learn`): `ppo_epochs` passes over the experience in shuffled mini-batches of
   `mini_batch_size`, each one optimizer step accumulated over micro-batches of
   `micro_batch_size`. Advantages are whitened (and clipped) over the whole rollout batch once,
   before it is split (5.3.1); every loss is a sum over tokens divided by the MINI-batch's token count, so the
   split into micro-batches does not change the update. The policy loss is the clipped surrogate
   minus the entropy bonus plus, with PPO-ptx, `ptx_coef` times the LM loss on SFT data (5.3.3);
   the critic loss is the (clipped) value loss. Policy and critic gradients are clipped to
   `max_grad_norm` separately. Until the value loss stops improving (`critic_pretraining.PlateauStop`,
   at most `critic_pretrain_steps` iterations) only the critic learns (5.3.3: critic pretraining
   instead of a learning-rate warmup); `steps` PPO iterations follow.

Validation (`PPOTrainer.validate`) samples one response per held-out prompt with the rollout settings
(so its KL estimate is on-policy) from fixed per-batch seeds, so validations are paired prompt by
prompt; each validated policy is saved, and at the end `selection.select_policy` picks the one
installed as `<checkpoint_dir>/best/`, the run's output.

Per-phase wall times (`time/generate_s`, `time/score_s`, `time/train_s`, `time/validate_s`) are
logged every iteration so a benchmark can split the cost.

Several ranks (a stage started by the `deepspeed` launcher, rlhf_core/distributed): each rank rolls
out its shard of every global prompt batch (`rollout_batch_size` prompts per rank) and learns from it
with mini-batches of `mini_batch_size` rows per rank. What spans the batch is reduced across ranks:
the running score statistics (`RunningMeanStd.update`), advantage whitening (over the global
rollout batch), the token counts that normalise every loss, the PPO-ptx shard and the logged update
metrics; the rollout monitors (and so the collapse guard) are computed on the gathered global
experience, and validation runs on every rank alike. Policy and critic are DeepSpeed engines
(`distributed.ppo_engines`); under ZeRO-3 the policy's weights are gathered ONCE around each batched
`generate` call (`distributed.zero`), not once per generated token. Only rank 0 logs and saves.
"""

from __future__ import annotations

import logging
import math
import shutil
import time
from collections import defaultdict
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.optim import AdamW
from torch.optim.lr_scheduler import LRScheduler
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from rlhf_core.config import DistributedConfig, PPOConfig
from rlhf_core.distributed.collectives import (
    gather_rows,
    global_masked_mean_var,
    group_size,
    sum_across_ranks,
    sum_counts,
    sum_metrics,
)
from rlhf_core.distributed.context import rank_context
from rlhf_core.distributed.sharding import shard
from rlhf_core.distributed.zero import gathered_for_generation, gathered_parameters
from rlhf_core.models.blocks import final_hidden_states
from rlhf_core.models.chat import (
    EncodedConversation,
    Messages,
    encode_conversation,
    encode_prompt,
)
from rlhf_core.models.heads import Critic
from rlhf_core.models.lora import make_trainable
from rlhf_core.atomic import atomic_directory
from rlhf_core.models.saving import save_causal_lm
from rlhf_core.ppo.advantages import clip_advantages, gae, whiten_advantages
from rlhf_core.ppo.critic_pretraining import PlateauStop
from rlhf_core.ppo.experience import Experience
from rlhf_core.ppo.guard import CollapseError, CollapseGuard, check_finite
from rlhf_core.ppo.kl import kl_k1
from rlhf_core.ppo.losses import (
    PolicyLossStats,
    ValueLossStats,
    policy_loss,
    reduce_tokens,
    value_loss,
)
from rlhf_core.ppo.monitors import (
    Metrics,
    SampleTable,
    experience_monitors,
    sample_rows,
    validation_monitors,
)
from rlhf_core.ppo.normalizers import RunningMeanStd
from rlhf_core.ppo.rewards import normalize_scores, scale_scores, token_level_rewards
from rlhf_core.ppo.selection import Selection, ValidationRecord, select_policy
from rlhf_core.ppo.rollout import (
    RewardModelScorer,
    Scorer,
    at_least_float32,
    chunks,
    generate_responses,
    left_pad,
    response_logprobs,
    response_values,
    stop_token_ids,
)
from rlhf_core.ppo.sequences import TrunkStates
from rlhf_core.ppo.shared_trunk import SharedTrunk, find_shared_trunk
from rlhf_core.training.batching import BatchPlan, fixed_size_plan
from rlhf_core.training.checkpoint import (
    TrainingState,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from rlhf_core.training.logger import MetricsLogger, NullLogger, RewindableLogger
from rlhf_core.training.loop import seed_everything
from rlhf_core.training.precision import autocast
from rlhf_core.training.schedules import build_scheduler

if TYPE_CHECKING:
    from rlhf_core.distributed.ppo_engines import PPOEngines

log = logging.getLogger(__name__)
BEST_DIR = "best"
VALIDATED_DIR = "validated"  # validated/step-<n>: every validated policy, until the selection
SAMPLES_PER_TABLE = 4
WHITENING_EPS = 1e-8  # as in rlhf_core.ppo.masked.masked_whiten

# --------------------------------------------------------------------------------------------------
# pure compositions of the math (what the wiring test checks switch by switch)


def penalize_unfinished(scores: Tensor, finished: Tensor, penalty: float) -> Tensor:
    """Add `penalty` to the score of every response cut without an end-of-turn token: ``[B]`` -> ``[B]``.

    In score units, after the running statistics took the raw scores (so the penalty never widens the
    std it is then normalised with) and before normalisation; validation rewards add it the same way.
    """
    return torch.where(finished, scores, scores + penalty)


def process_scores(scores: Tensor, score_stats: RunningMeanStd, config: PPOConfig) -> Tensor:
    """Paper 5.3.1: normalise (or scale) ``[B]`` scores by the running statistics, then clip to +-delta.

    `score_stats` must already include these scores. Normalisation wins when both it and scaling
    are switched on (it subtracts the mean and divides by the same std); with neither, `reward_clip`
    clips the raw scores.
    """
    if config.reward_normalization:
        return normalize_scores(scores, score_stats, config.reward_clip)
    if config.reward_scaling:
        return scale_scores(scores, score_stats, config.reward_clip)
    if config.reward_clip is not None:
        return scores.clamp(-config.reward_clip, config.reward_clip)
    return scores


def assemble_experience(
    *,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    response_ids: Tensor,
    response_mask: Tensor,
    finished: Tensor,
    logprobs: Tensor,
    ref_logprobs: Tensor,
    entropy: Tensor,
    values: Tensor,
    scores: Tensor,
    score_stats: RunningMeanStd,
    config: PPOConfig,
    trunk_residual: Tensor | None = None,
) -> Experience:
    """The rollout's tensors (shapes in `Experience`) -> the full `Experience` PPO learns from.

    Unfinished penalty, score processing (5.3.1), the token-level KL-penalised reward with the k1
    estimator (5.3.2, ``rewards.token_level_rewards``) and GAE (3.2). `score_stats` must already
    include this batch's RAW scores; nothing here updates it.
    """
    real = response_mask.bool()
    processed = process_scores(
        penalize_unfinished(scores, finished, config.unfinished_penalty), score_stats, config
    )
    kl = torch.where(real, kl_k1(logprobs, ref_logprobs), 0.0)
    rewards = token_level_rewards(processed, kl, response_mask, config.kl_coef)
    advantages, returns = gae(rewards, values, response_mask, config.gamma, config.lam)
    return Experience(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        response_ids=response_ids,
        response_mask=response_mask,
        finished=finished,
        logprobs=logprobs,
        ref_logprobs=ref_logprobs,
        entropy=entropy,
        values=values,
        scores=scores,
        processed_scores=processed,
        kl=kl,
        rewards=rewards,
        advantages=advantages,
        returns=returns,
        trunk_residual=trunk_residual,
    )


def whiten_across_ranks(advantages: Tensor, mask: Tensor) -> Tensor:
    """`whiten_advantages` over the GLOBAL rollout batch: every rank's rows of it (a collective).

    One process: exactly `whiten_advantages`. Several ranks: the mean and unbiased variance of the real
    entries of all ranks' rows (`collectives.global_masked_mean_var`), applied to this rank's rows.
    """
    if group_size() == 1:
        return whiten_advantages(advantages, mask)
    mean, var = global_masked_mean_var(advantages, mask)
    return torch.where(mask.bool(), (advantages - mean) * torch.rsqrt(var + WHITENING_EPS), 0.0)


def loss_advantages(advantages: Tensor, mask: Tensor, config: PPOConfig) -> Tensor:
    """The advantages the policy loss uses: whitened over the rollout batch, then clipped (paper 5.3.1).

    ``[B, T]`` -> ``[B, T]`` for the whole rollout batch, before it is split into mini-batches (a
    mini-batch of 4 responses is too few to estimate a mean and std from). With several ranks the
    batch is the union of their rows (`whiten_across_ranks`).
    """
    if config.advantage_normalization:
        advantages = whiten_across_ranks(advantages, mask)
    if config.advantage_clip is not None:
        advantages = clip_advantages(advantages, config.advantage_clip)
    return advantages


def behaviour_logprobs(batch: Experience, config: PPOConfig) -> Tensor:
    """The importance-sampling denominator ``[B, T]``: the rollout policy's log-probs, or the
    reference model's (the paper's "infinite buffer" variant, 5.3.2)."""
    return batch.ref_logprobs if config.behaviour_logprobs == "reference" else batch.logprobs


def policy_terms(
    logprobs: Tensor,
    entropy: Tensor,
    batch: Experience,
    advantages: Tensor,
    config: PPOConfig,
    num_tokens: int,
) -> tuple[Tensor, Tensor, PolicyLossStats]:
    """Clipped surrogate and mean entropy (0-d, token sums / `num_tokens`) of one micro-batch.

    `logprobs`, `entropy` ``[B, T]`` come from the policy being trained (with gradient); `advantages`
    is the micro-batch's slice of `loss_advantages`.
    """
    mask = batch.response_mask
    per_token, stats = policy_loss(
        logprobs, behaviour_logprobs(batch, config), advantages, mask, config.clip_eps
    )
    return reduce_tokens(per_token, mask, num_tokens), reduce_tokens(entropy, mask, num_tokens), stats


def policy_objective(surrogate: Tensor, entropy: Tensor, ptx: Tensor, config: PPOConfig) -> Tensor:
    """What the policy minimises: surrogate - entropy_coef * entropy + ptx_coef * PPO-ptx LM loss."""
    return surrogate - config.entropy_coef * entropy + config.ptx_coef * ptx


def value_terms(
    values: Tensor, batch: Experience, config: PPOConfig, num_tokens: int
) -> tuple[Tensor, ValueLossStats]:
    """Critic loss (0-d, token sum / `num_tokens`) of one micro-batch; `values` ``[B, T]`` with gradient."""
    mask = batch.response_mask
    per_token, stats = value_loss(values, batch.values, batch.returns, mask, config.value_clip)
    return reduce_tokens(per_token, mask, num_tokens), stats


# --------------------------------------------------------------------------------------------------
# PPO-ptx: the SFT language-modelling loss mixed into the policy loss (paper 5.3.3)


@dataclass(frozen=True)
class PtxBatch:
    """Right-padded SFT conversations: ids, attention mask and the reply tokens to predict, ``[B, L]``."""

    input_ids: Tensor
    attention_mask: Tensor
    loss_mask: Tensor


def encode_ptx_example(
    tokenizer: PreTrainedTokenizerBase, messages: Messages, reply: str, max_length: int
) -> EncodedConversation:
    """Prompt + reply + end-of-turn ids cut from the LEFT to `max_length` (the reply's end always stays)."""
    full = encode_conversation(tokenizer, messages, reply)
    cut = max(0, len(full.input_ids) - max_length)
    return EncodedConversation(input_ids=full.input_ids[cut:], reply_start=max(0, full.reply_start - cut))


def collate_ptx(examples: Sequence[EncodedConversation], pad_id: int, device: torch.device) -> PtxBatch:
    """Right-pad encoded conversations; the loss covers the reply tokens (never the first token)."""
    width = max(len(example.input_ids) for example in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(examples), width), dtype=torch.long)
    loss_mask = torch.zeros((len(examples), width), dtype=torch.long)
    for row, example in enumerate(examples):
        length = len(example.input_ids)
        ids[row, :length] = torch.tensor(example.input_ids)
        attention[row, :length] = 1
        loss_mask[row, max(1, example.reply_start) : length] = 1
    return PtxBatch(ids.to(device), attention.to(device), loss_mask.to(device))


def ptx_nll_sum(lm: PreTrainedModel, batch: PtxBatch) -> Tensor:
    """Sum of the reply tokens' negative log-likelihoods (temperature 1, the SFT objective) -> 0-d.

    The LM head is applied only at the positions that predict a reply token.
    """
    hidden = final_hidden_states(lm.base_model, batch.input_ids, batch.attention_mask)
    predicts_reply = batch.loss_mask[:, 1:].bool()
    logits = lm.get_output_embeddings()(hidden[:, :-1][predicts_reply])
    return F.cross_entropy(at_least_float32(logits), batch.input_ids[:, 1:][predicts_reply], reduction="sum")


# --------------------------------------------------------------------------------------------------
# the trainer


@dataclass
class PPOModels:
    """The four models of PPO (paper 5.1): two trained, two frozen."""

    policy: PreTrainedModel  # trained; starts as the SFT model
    reference: PreTrainedModel  # frozen copy of the SFT model: the KL anchor
    critic: Critic  # trained; starts from the reward model (or SFT + a fresh head)
    scorer: Scorer  # frozen reward model (`rollout.RewardModelScorer`) or, in tests, a rule


@dataclass(frozen=True)
class PPOData:
    """Prompts to train on and to validate on (held out of training), and SFT pairs for PPO-ptx."""

    prompts: Sequence[Messages]
    val_prompts: Sequence[Messages]
    ptx_examples: Sequence[tuple[Messages, str]] = ()
    val_prompt_ids: Sequence[str] = ()  # ids of `val_prompts` (for the record); default: their positions


def build_ppo_optimizer(policy: nn.Module, critic: nn.Module, config: PPOConfig) -> AdamW:
    """One AdamW with a "policy" and a "critic" parameter group, each with its own learning rate.

    Adam's state is per parameter, so this is exactly two optimizers; one object keeps the checkpoint
    format of the shared training loop. No weight decay (the paper uses none for PPO).
    """
    groups = [
        {
            "params": [p for p in policy.parameters() if p.requires_grad],
            "lr": config.policy_lr,
            "name": "policy",
        },
        {
            "params": [p for p in critic.parameters() if p.requires_grad],
            "lr": config.critic_lr,
            "name": "critic",
        },
    ]
    return AdamW(groups, weight_decay=0.0)


def validated_dir(root: Path, step: int) -> Path:
    """Where the policy validated after iteration `step` is kept until the selection."""
    return root / VALIDATED_DIR / f"step-{step}"


def _trainable(module: nn.Module) -> list[nn.Parameter]:
    return [p for p in module.parameters() if p.requires_grad]


def _average(updates: list[Metrics]) -> Metrics:
    """Mean of each metric over the optimizer steps of one iteration."""
    totals: dict[str, float] = defaultdict(float)
    for update in updates:
        for name, value in update.items():
            totals[name] += value
    return {name: value / len(updates) for name, value in totals.items()}


def _pad_columns(tensor: Tensor, width: int) -> Tensor:
    """Right-pad a ``[B, T]`` tensor with zeros to ``[B, width]``."""
    return F.pad(tensor, (0, width - tensor.shape[1]))


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


class PPOTrainer:
    """Holds the models, the optimizer and the run's state; each method is one phase of an iteration.

    Its state (`state_dict`) is everything besides weights, optimizer and RNG that an exact resume
    needs: running score statistics, the guard's baseline, the positions in the prompt and SFT
    streams, and the best validation so far.

    In one process `optimizer` (AdamW, a "policy" and a "critic" group) and `scheduler` update the
    models; in a process started by the `deepspeed` launcher, `engines` (one DeepSpeed engine per
    trained model, configured by `distributed`) do, and `optimizer` and `scheduler` do not exist.
    """

    def __init__(
        self,
        models: PPOModels,
        tokenizer: PreTrainedTokenizerBase,
        data: PPOData,
        config: PPOConfig,
        seed: int,
        bf16: bool = False,
        distributed: DistributedConfig | None = None,
    ) -> None:
        self.models = models
        self.tokenizer = tokenizer
        self.data = data
        self.config = config
        self.seed = seed
        self.bf16 = bf16
        self.device = next(models.policy.parameters()).device
        self.pad_id = tokenizer.pad_token_id
        self.stop_ids = stop_token_ids(tokenizer)
        models.reference.requires_grad_(False).eval()
        make_trainable(models.policy, config.trainable_top_layers, config.lora, seed)
        make_trainable(
            models.critic, config.trainable_top_layers, config.lora, seed, heads=[models.critic.value_head]
        )
        self.trainable = nn.ModuleDict({"policy": models.policy, "critic": models.critic})
        self.context = rank_context()
        self.critic_pretraining = PlateauStop(
            config.critic_pretrain_steps, config.critic_pretrain_patience, config.critic_pretrain_min_improvement
        )
        self.pretrain_end: int | None = 0 if config.critic_pretrain_steps == 0 else None
        self.trunk = self._shared_trunk()
        self.engines: PPOEngines | None = None
        if self.context.is_distributed:
            if distributed is None:
                rank, world = self.context.rank, self.context.world_size
                raise ValueError(f"this process is rank {rank} of {world}: pass `distributed`")
            from rlhf_core.distributed.ppo_engines import PPOEngines  # imports deepspeed

            self.engines = PPOEngines(
                models.policy, models.critic, config, distributed, self.context, self.total_steps, bf16
            )
        else:
            self.optimizer = build_ppo_optimizer(models.policy, models.critic, config)
            self.scheduler: LRScheduler = build_scheduler(
                self.optimizer, "warmup_constant", self.total_steps, 0.0, 1.0
            )
        self.prompt_plan = self._prompt_plan()
        self.ptx_plan = self._ptx_plan()
        names = list(data.val_prompt_ids) or [str(index) for index in range(len(data.val_prompts))]
        validation = sorted(  # by length: validation batches need little padding
            (
                (encode_prompt(tokenizer, messages, config.max_prompt_tokens), name)
                for messages, name in zip(data.val_prompts[: config.val_prompts], names)
            ),
            key=lambda item: len(item[0]),
        )
        if len(validation) < 2:
            raise ValueError(
                f"PPO validation needs at least 2 held-out prompts (paired standard errors); got {len(validation)}"
            )
        self.val_prompt_tokens = [tokens for tokens, _ in validation]
        self.val_prompt_names = [name for _, name in validation]  # in the order of every validation's rewards
        self.score_stats = RunningMeanStd()
        self.guard = CollapseGuard(config.guard)
        self.prompt_batches_used = 0
        self.ptx_steps_used = 0
        self.validations: list[ValidationRecord] = []

    @property
    def total_steps(self) -> int:
        """Iterations of the run: the critic-only ones first (at most `critic_pretrain_steps` while they
        last), then `steps` PPO iterations."""
        pretraining = self.config.critic_pretrain_steps if self.pretrain_end is None else self.pretrain_end
        return pretraining + self.config.steps

    def _prompt_plan(self) -> BatchPlan:
        """The global prompt stream: `rollout_batch_size` prompts per rank and iteration."""
        global_batch = self.config.rollout_batch_size * self.context.world_size
        if len(self.data.prompts) < global_batch:
            raise ValueError(
                f"PPO needs at least rollout_batch_size={self.config.rollout_batch_size} training prompts "
                f"per rank ({self.context.world_size} ranks), got {len(self.data.prompts)}"
            )
        return fixed_size_plan(len(self.data.prompts), self.seed, global_batch, 1)

    def _ptx_plan(self) -> BatchPlan | None:
        if self.config.ptx_coef == 0:
            return None
        if len(self.data.ptx_examples) < self.config.mini_batch_size:
            raise ValueError(
                f"PPO-ptx (ptx_coef={self.config.ptx_coef:g}) needs at least mini_batch_size="
                f"{self.config.mini_batch_size} SFT examples, got {len(self.data.ptx_examples)}"
            )
        accumulation = self.config.mini_batch_size // self.config.micro_batch_size * self.context.world_size
        return fixed_size_plan(
            len(self.data.ptx_examples), self.seed + 1, self.config.micro_batch_size, accumulation
        )

    def _shared_trunk(self) -> SharedTrunk | None:
        """The frozen lower blocks the models share (shared_trunk.py), when switched on and found."""
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
            log.info(
                "shared trunk: the lower %d blocks of the policy, shared with %s",
                trunk.num_lower,
                ", ".join(sorted(trunk.members)),
            )
        return trunk

    @torch.no_grad()
    def _trunk_states(
        self, prompt: tuple[Tensor, Tensor], response: tuple[Tensor, Tensor]
    ) -> TrunkStates | None:
        """The shared trunk's residual stream of a sampled batch (None without a shared trunk)."""
        if self.trunk is None:
            return None
        with self._autocast():
            return self.trunk.states(prompt, response, self.config.micro_batch_size)

    def _trunk_for(self, model: str, states: TrunkStates | None) -> TrunkStates | None:
        """`states` when `model` starts its passes from the shared trunk, else None (a full forward)."""
        if states is None or self.trunk is None or not self.trunk.serves(model):
            return None
        return states

    def _experience_trunk(self, experience: Experience, model: str) -> TrunkStates | None:
        """The rollout's shared-trunk states of `experience`'s rows, for `model`'s update pass."""
        if experience.trunk_residual is None or self.trunk is None:
            return None
        return self._trunk_for(model, TrunkStates(experience.trunk_residual, self.trunk.num_lower))

    def _autocast(self) -> AbstractContextManager[object]:
        return autocast(self.device, self.bf16)

    def _whole_policy(self) -> AbstractContextManager[None]:
        """For sampling: a ZeRO-3 policy gathered once for the block (else nothing to do)."""
        return gathered_for_generation(self.engines.engines["policy"] if self.engines is not None else None)

    # ---- rollout ---------------------------------------------------------------------------------

    def next_prompts(self) -> list[list[int]]:
        """Token ids of the next rollout batch of the prompt stream (a seeded reshuffle each epoch).

        Sorted by length, so the micro-batches of the scoring passes need little padding.
        """
        (rows,) = self.prompt_plan.step(self.prompt_batches_used)
        rows = shard(rows, self.context)
        self.prompt_batches_used += 1
        log.debug(
            "rank %d of %d, step %d: prompts %s",
            self.context.rank,
            self.context.world_size,
            self.prompt_batches_used,
            rows,
        )
        prompts = [
            encode_prompt(self.tokenizer, self.data.prompts[i], self.config.max_prompt_tokens) for i in rows
        ]
        return sorted(prompts, key=len)

    @torch.no_grad()
    def _logprobs(
        self,
        model: PreTrainedModel,
        prompt: tuple[Tensor, Tensor],
        response: tuple[Tensor, Tensor],
        trunk: TrunkStates | None,
    ) -> Tensor:
        """Log-probs ``[B, T]`` of the responses under `model`, micro-batch by micro-batch."""
        parts = []
        for rows in chunks(prompt[0].shape[0], self.config.micro_batch_size):
            with self._autocast():
                logprobs, _ = response_logprobs(
                    model,
                    prompt[0][rows],
                    prompt[1][rows],
                    response[0][rows],
                    response[1][rows],
                    self.config.rollout.temperature,
                    trunk=trunk.select(rows) if trunk is not None else None,
                )
            parts.append(logprobs)
        return torch.cat(parts)

    @torch.no_grad()
    def _policy_logprobs_and_entropy(
        self, prompt: tuple[Tensor, Tensor], response: tuple[Tensor, Tensor], trunk: TrunkStates | None
    ) -> tuple[Tensor, Tensor]:
        """The rollout policy's log-probs and entropy ``[B, T]``, micro-batch by micro-batch."""
        logprobs, entropy = [], []
        for rows in chunks(prompt[0].shape[0], self.config.micro_batch_size):
            with self._autocast():
                part_logprobs, part_entropy = response_logprobs(
                    self.models.policy,
                    prompt[0][rows],
                    prompt[1][rows],
                    response[0][rows],
                    response[1][rows],
                    self.config.rollout.temperature,
                    with_entropy=True,
                    trunk=trunk.select(rows) if trunk is not None else None,
                )
            assert part_entropy is not None
            logprobs.append(part_logprobs)
            entropy.append(part_entropy)
        return torch.cat(logprobs), torch.cat(entropy)

    @torch.no_grad()
    def _values(
        self, prompt: tuple[Tensor, Tensor], response: tuple[Tensor, Tensor], trunk: TrunkStates | None
    ) -> Tensor:
        """Critic values ``[B, T]`` of the rollout, micro-batch by micro-batch."""
        parts = []
        for rows in chunks(prompt[0].shape[0], self.config.micro_batch_size):
            with self._autocast():
                parts.append(
                    response_values(
                        self.models.critic,
                        prompt[0][rows],
                        prompt[1][rows],
                        response[0][rows],
                        response[1][rows],
                        trunk=trunk.select(rows) if trunk is not None else None,
                    )
                )
        return torch.cat(parts)

    @torch.no_grad()
    def _scores(
        self, prompt: tuple[Tensor, Tensor], response: tuple[Tensor, Tensor], trunk: TrunkStates | None
    ) -> Tensor:
        """The scorer's raw scores ``[B]`` (the reward model's upper blocks only, with `trunk`)."""
        scorer = self.models.scorer
        if trunk is not None and isinstance(scorer, RewardModelScorer):
            with self._autocast():
                return at_least_float32(scorer.score(*prompt, *response, trunk=trunk))
        return at_least_float32(scorer(*prompt, *response))

    @torch.no_grad()
    def make_experience(self, prompts: list[list[int]]) -> tuple[Experience, Metrics]:
        """Sample, judge and assemble one `Experience`; also returns the phase timings and token count.

        Updates the running score statistics with this batch's raw scores (before normalising it, see
        `rewards.py`; the unfinished penalty comes after, `penalize_unfinished`).
        """
        self.models.policy.eval()
        self.models.critic.eval()
        prompt = left_pad(prompts, self.pad_id, self.device)
        started = time.perf_counter()
        with self._whole_policy(), self._autocast():
            response_ids, response_mask, finished = generate_responses(
                self.models.policy, *prompt, self.config.rollout, self.stop_ids, self.pad_id
            )
        generated = time.perf_counter()
        response = (response_ids, response_mask)
        trunk = self._trunk_states(prompt, response)
        logprobs, entropy = self._policy_logprobs_and_entropy(prompt, response, trunk)
        ref_logprobs = self._logprobs(
            self.models.reference, prompt, response, self._trunk_for("reference", trunk)
        )
        values = self._values(prompt, response, self._trunk_for("critic", trunk))
        scores = self._scores(prompt, response, self._trunk_for("reward_model", trunk))
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
        }
        return experience, timings

    def rollout(self, step: int) -> tuple[Experience, Metrics]:
        """Phase 1 of iteration `step`: the next prompts' experience and all its monitors."""
        experience, metrics = self.make_experience(self.next_prompts())
        metrics.update(experience_monitors(gather_experience(experience, self.pad_id)))
        metrics["policy/updating"] = float(self.trains_policy(step))
        return experience, metrics

    def trains_policy(self, step: int) -> bool:
        """Whether iteration `step` (1-based) updates the policy: not during critic pretraining."""
        return self.pretrain_end is not None and step > self.pretrain_end

    def _end_critic_pretraining_if_done(self, step: int, metrics: Metrics) -> None:
        """After critic-only iteration `step`: end the phase once the value loss stops improving."""
        if self.pretrain_end is None and self.critic_pretraining.update(metrics["loss/value"]):
            self.pretrain_end = step
            log.info("critic pretraining ended after %d iterations (value loss %.4g)", step, metrics["loss/value"])

    def validates_after(self, step: int) -> bool:
        """Whether iteration `step` is followed by a validation: every `eval_every` PPO iterations and
        after the last (never during critic pretraining: the policy has not moved)."""
        if not self.trains_policy(step):
            return False
        assert self.pretrain_end is not None
        return (step - self.pretrain_end) % self.config.eval_every == 0 or step == self.total_steps

    # ---- update ----------------------------------------------------------------------------------

    def _next_ptx_batches(self) -> list[PtxBatch]:
        """The SFT micro-batches of the next policy optimizer step (one per PPO micro-batch)."""
        assert self.ptx_plan is not None
        micro_batches = shard(self.ptx_plan.step(self.ptx_steps_used), self.context)
        self.ptx_steps_used += 1
        max_length = self.config.max_prompt_tokens + self.config.rollout.max_new_tokens
        return [
            collate_ptx(
                [encode_ptx_example(self.tokenizer, *self.data.ptx_examples[i], max_length) for i in rows],
                self.pad_id,
                self.device,
            )
            for rows in micro_batches
        ]

    def learn(self, experience: Experience, step: int) -> Metrics:
        """Phase 3: `ppo_epochs` shuffled passes of mini-batch updates; returns their mean metrics.

        The advantages are whitened and clipped over the whole rollout batch first (`loss_advantages`).
        A critic-only iteration may end critic pretraining (`critic_pretraining.PlateauStop`).
        """
        started = time.perf_counter()
        size = self.config.mini_batch_size
        experience = replace(
            experience, advantages=loss_advantages(experience.advantages, experience.response_mask, self.config)
        )
        train_policy = self.trains_policy(step)
        updates = []
        for _ in range(self.config.ppo_epochs):
            order = torch.randperm(experience.batch_size, device=self.device)
            for first in range(0, experience.batch_size, size):
                batch = experience.select(order[first : first + size])
                updates.append(self.update_minibatch(batch, train_policy, step))
        metrics = {**_average(updates), "time/train_s": time.perf_counter() - started}
        if not train_policy:
            self._end_critic_pretraining_if_done(step, metrics)
        return metrics

    def update_minibatch(self, batch: Experience, train_policy: bool, step: int) -> Metrics:
        """One optimizer step on one mini-batch, accumulated over its micro-batches.

        Raises `CollapseError` ("finite") before the optimizer steps if a loss or gradient norm is
        NaN or infinite, so no bad update is ever applied.
        """
        num_tokens = sum_counts({"tokens": int(batch.response_mask.sum())})["tokens"]  # of all ranks
        ptx_batches = self._next_ptx_batches() if train_policy and self.ptx_plan is not None else []
        local_ptx_tokens = sum(int(ptx.loss_mask[:, 1:].sum()) for ptx in ptx_batches)
        ptx_tokens = sum_counts({"tokens": local_ptx_tokens})["tokens"]
        self.trainable.train()
        metrics: dict[str, float] = defaultdict(float)
        for index, rows in enumerate(chunks(batch.batch_size, self.config.micro_batch_size)):
            micro = batch.select(torch.arange(batch.batch_size, device=self.device)[rows])
            self._critic_backward(micro, num_tokens, step, metrics)
            if train_policy:
                ptx = (ptx_batches[index], ptx_tokens) if ptx_batches else None
                self._policy_backward(micro, num_tokens, ptx, step, metrics)
        norms = self._clip_and_step(train_policy, step)
        return {**sum_metrics(dict(metrics)), **norms}  # each rank's share of the global mini-batch

    def _critic_backward(
        self, micro: Experience, num_tokens: int, step: int, metrics: dict[str, float]
    ) -> None:
        """Value loss of one micro-batch (normalised by the mini-batch's `num_tokens`) and its gradient."""
        with self._autocast():
            values = response_values(
                self.models.critic,
                micro.prompt_ids,
                micro.prompt_mask,
                micro.response_ids,
                micro.response_mask,
                trunk=self._experience_trunk(micro, "critic"),
            )
            loss, stats = value_terms(values, micro, self.config, num_tokens)
        self._backward("critic", "loss/value", loss, step, metrics)
        share = int(micro.response_mask.sum()) / num_tokens  # weights this micro-batch's mean statistics
        metrics["value/clip_fraction"] += share * float(stats.clip_fraction)

    def _policy_backward(
        self,
        micro: Experience,
        num_tokens: int,
        ptx: tuple[PtxBatch, int] | None,
        step: int,
        metrics: dict[str, float],
    ) -> None:
        """Policy objective of one micro-batch (with its PPO-ptx micro-batch and the mini-batch's PPO-ptx
        token count, if any) and its gradient."""
        config = self.config
        with self._autocast():
            logprobs, entropy = response_logprobs(
                self.models.policy,
                micro.prompt_ids,
                micro.prompt_mask,
                micro.response_ids,
                micro.response_mask,
                config.rollout.temperature,
                with_entropy=config.entropy_coef > 0,
                trunk=self._experience_trunk(micro, "policy"),
            )
            entropy = entropy if entropy is not None else torch.zeros_like(logprobs)
            surrogate, mean_entropy, stats = policy_terms(
                logprobs, entropy, micro, micro.advantages, config, num_tokens
            )
            ptx_loss = ptx_nll_sum(self.models.policy, ptx[0]) / ptx[1] if ptx else surrogate.new_zeros(())
        self._backward(
            "policy",
            "loss/policy_total",
            policy_objective(surrogate, mean_entropy, ptx_loss, config),
            step,
            metrics,
        )
        share = int(micro.response_mask.sum()) / num_tokens
        metrics["loss/policy"] += surrogate.item()
        metrics["loss/entropy"] += mean_entropy.item()
        metrics["loss/ptx"] += ptx_loss.item()
        metrics["policy/clip_fraction"] += share * float(stats.clip_fraction)
        metrics["policy/approx_kl"] += share * float(stats.approx_kl)
        metrics["policy/ratio_mean"] += share * float(stats.ratio_mean)

    def _backward(
        self,
        model: Literal["policy", "critic"],
        name: str,
        loss: Tensor,
        step: int,
        metrics: dict[str, float],
    ) -> None:
        """Check the loss is finite, add it to `metrics[name]` and accumulate `model`'s gradient."""
        value = loss.item()
        if not math.isfinite(value):
            self._discard_gradients()
        check_finite(name, value, step)
        metrics[name] += value
        if self.engines is not None:
            self.engines.backward(model, loss)
        else:
            loss.backward()

    def _discard_gradients(self) -> None:
        if self.engines is not None:
            self.engines.discard_gradients()
        else:
            self.optimizer.zero_grad(set_to_none=True)

    def _clip_and_step(self, train_policy: bool, step: int) -> Metrics:
        """Clip each model's gradient to `max_grad_norm` (global norm, 5.3.2), then one optimizer step.

        With engines, each engine has already clipped and stepped (or skipped a non-finite step).
        """
        if self.engines is not None:
            norms = self.engines.grad_norms(train_policy)
            for name, norm in norms.items():
                check_finite(name, norm, step)
            return norms
        max_norm = self.config.max_grad_norm if self.config.max_grad_norm is not None else math.inf
        norms = {
            "critic/grad_norm": float(
                torch.nn.utils.clip_grad_norm_(_trainable(self.models.critic), max_norm)
            )
        }
        if train_policy:
            norms["policy/grad_norm"] = float(
                torch.nn.utils.clip_grad_norm_(_trainable(self.models.policy), max_norm)
            )
        for name, norm in norms.items():
            if not math.isfinite(norm):
                self.optimizer.zero_grad(set_to_none=True)
            check_finite(name, norm, step)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norms

    # ---- validation ------------------------------------------------------------------------------

    def _validation_rng(self) -> AbstractContextManager[object]:
        """A fixed random stream for validation that leaves the training stream untouched."""
        devices = [self.device] if self.device.type == "cuda" else []
        return torch.random.fork_rng(devices=devices)

    @torch.no_grad()
    def validate(self) -> tuple[Metrics, list[float]]:
        """Monitors on the held-out prompts (`val/...`, paper 5.2) and the reward of each prompt.

        A prompt's reward is what training optimises, less the KL term: the reward model's score plus
        `unfinished_penalty` when the response was cut. Each batch of prompts samples from its own fixed
        seed, so successive validations differ only by the policy (paired, `selection.py`), and
        training's random stream is not consumed.
        """
        started = time.perf_counter()
        self.models.policy.eval()
        parts: dict[str, list[Tensor]] = defaultdict(list)
        with self._validation_rng(), self._whole_policy():
            for index, rows in enumerate(chunks(len(self.val_prompt_tokens), self.config.rollout_batch_size)):
                torch.manual_seed(self.seed + index)
                prompt = left_pad(self.val_prompt_tokens[rows], self.pad_id, self.device)
                with self._autocast():
                    response_ids, mask, finished = generate_responses(
                        self.models.policy, *prompt, self.config.rollout, self.stop_ids, self.pad_id
                    )
                response = (response_ids, mask)
                trunk = self._trunk_states(prompt, response)
                parts["logprobs"].append(self._logprobs(self.models.policy, prompt, response, trunk))
                parts["ref_logprobs"].append(
                    self._logprobs(self.models.reference, prompt, response, self._trunk_for("reference", trunk))
                )
                parts["scores"].append(self._scores(prompt, response, self._trunk_for("reward_model", trunk)))
                parts["finished"].append(finished)
                parts["mask"].append(mask)
        width = max(mask.shape[1] for mask in parts["mask"])
        scores, finished = torch.cat(parts["scores"]), torch.cat(parts["finished"])
        rewards = penalize_unfinished(scores, finished, self.config.unfinished_penalty)
        metrics = validation_monitors(
            rewards=rewards,
            scores=scores,
            finished=finished,
            logprobs=torch.cat([_pad_columns(t, width) for t in parts["logprobs"]]),
            ref_logprobs=torch.cat([_pad_columns(t, width) for t in parts["ref_logprobs"]]),
            mask=torch.cat([_pad_columns(t, width) for t in parts["mask"]]),
        )
        return {**metrics, "time/validate_s": time.perf_counter() - started}, rewards.tolist()

    def record_validation(self, step: int, validation: Metrics, rewards: list[float], root: Path) -> None:
        """Keep this validation's per-prompt rewards and save the policy to `root/validated/step-<step>`."""
        with gathered_parameters(self.models.policy):  # every rank alike; rank 0 writes
            if self.context.is_main:
                save_causal_lm(self.models.policy, self.tokenizer, validated_dir(root, step))
        self.validations.append(ValidationRecord(step=step, kl=validation["val/kl"], rewards=tuple(rewards)))

    def select(self, root: Path) -> Selection:
        """Apply `selection.select_policy` to the validations and install the chosen policy as `best/`."""
        selection = select_policy(self.validations, self.config.guard.max_kl)
        if self.context.is_main:
            with atomic_directory(root / BEST_DIR) as temporary:
                shutil.copytree(validated_dir(root, selection.step), temporary, dirs_exist_ok=True)
        return selection

    # ---- state -----------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The run state besides weights, optimizer and RNG (plain numbers, checkpointable as is)."""
        return {
            "score_stats": self.score_stats.state_dict(),
            "guard": self.guard.state_dict(),
            "prompt_batches_used": self.prompt_batches_used,
            "ptx_steps_used": self.ptx_steps_used,
            "critic_pretraining": self.critic_pretraining.state_dict(),
            "pretrain_end": self.pretrain_end,
            "validations": [record.to_dict() for record in self.validations],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.score_stats.load_state_dict(state["score_stats"])
        self.guard.load_state_dict(state["guard"])
        self.prompt_batches_used = int(state["prompt_batches_used"])
        self.ptx_steps_used = int(state["ptx_steps_used"])
        self.critic_pretraining.load_state_dict(state["critic_pretraining"])
        self.pretrain_end = state["pretrain_end"]
        self.validations = [ValidationRecord.from_dict(record) for record in state["validations"]]

    def save_checkpoint(self, root: Path, step: int, metrics: Metrics) -> Path:
        """Policy + critic weights, optimizer, scheduler, RNG states and `state_dict`, atomically."""
        state = TrainingState(step=step, best_metric=None, metrics=metrics, extra=self.state_dict())
        if self.engines is not None:
            return self.engines.save(root, state, self.config.keep_checkpoints)
        return save_checkpoint(
            root, state, self.trainable, self.optimizer, self.scheduler, self.config.keep_checkpoints
        )

    def resume(self, root: Path) -> TrainingState:
        """Restore the newest complete checkpoint under `root` in place; step 0 when there is none."""
        latest = latest_checkpoint(root)
        if latest is None:
            return TrainingState(step=0)
        if self.engines is not None:
            state = self.engines.restore(latest)
        else:
            state = load_checkpoint(latest, self.trainable, self.optimizer, self.scheduler)
        if state.step > self.total_steps:
            raise ValueError(
                f"checkpoint {latest} is past the end of this run ({self.total_steps} iterations)"
            )
        self.load_state_dict(state.extra)
        return state


# --------------------------------------------------------------------------------------------------
# the run


@dataclass(frozen=True)
class FitResult:
    """How a run ended. Step 0 is the initial (SFT) policy; `selection` names the policy in `best/`."""

    final_step: int  # the last iteration whose update was applied
    resumed_from: int
    total_steps: int
    critic_pretrain_steps: int  # critic-only iterations run (PlateauStop)
    selection: Selection
    validations: list[ValidationRecord]
    metrics: Metrics  # the last logged iteration's monitors
    stop: CollapseError | None  # why the guard stopped the run, or None


def _rewind(logger: MetricsLogger, samples: SampleTable | None, step: int) -> None:
    """Drop history written after `step` by an interrupted run (everything, -1, on a fresh start)."""
    if isinstance(logger, RewindableLogger):
        logger.truncate_after(step)
    if samples is not None:
        samples.truncate_after(step)


def fit(
    trainer: PPOTrainer,
    checkpoint_dir: str | Path,
    logger: MetricsLogger | None = None,
    samples: SampleTable | None = None,
    progress_bar: bool = False,
) -> FitResult:
    """Run (or resume) the whole PPO run; the selected policy ends up in `<checkpoint_dir>/best/`.

    Validates the initial policy at step 0 (the SFT baseline), then every `eval_every` PPO iterations
    and after the last; `PPOTrainer.select` then picks the output among the validated policies.
    Checkpoints every `checkpoint_every` iterations and after the last; a rerun resumes from the newest
    one and repeats exactly what the interrupted run would have done. When the collapse guard stops
    the run, the stopping iteration's monitors are logged and the result carries the `CollapseError`.
    """
    config = trainer.config
    root = Path(checkpoint_dir)
    logger = logger if logger is not None else NullLogger()
    # Each rank its own sampling stream (rank 0's is the single-process one); plans are seeded apart.
    seed_everything(trainer.seed + trainer.context.rank)
    state = trainer.resume(root)
    _rewind(logger, samples, state.step if state.step > 0 else -1)
    metrics = dict(state.metrics)
    if state.step == 0:
        validation, rewards = trainer.validate()
        trainer.record_validation(0, validation, rewards, root)
        logger.log_metrics({**validation, "progress": 0.0}, 0)
    stop = None
    step = final_step = state.step
    with tqdm(total=trainer.total_steps, initial=step, disable=not progress_bar, desc="ppo") as progress:
        while step < trainer.total_steps:
            step += 1
            experience, metrics = trainer.rollout(step)
            try:
                trainer.guard.check(metrics, step, initial_policy=not trainer.trains_policy(step - 1))
                metrics.update(trainer.learn(experience, step))
            except CollapseError as error:
                logger.log_metrics({**metrics, "guard/stopped": 1.0}, step)
                stop = error
                break
            progress.total = trainer.total_steps  # known once critic pretraining has ended
            if samples is not None and step % config.sample_table_every == 0:
                samples.write(step, sample_rows(experience, trainer.tokenizer, SAMPLES_PER_TABLE))
            if trainer.validates_after(step):
                validation, rewards = trainer.validate()
                trainer.record_validation(step, validation, rewards, root)
                metrics.update(validation)
            metrics["progress"] = step / trainer.total_steps
            logger.log_metrics(metrics, step)
            if step % config.checkpoint_every == 0 or step == trainer.total_steps:
                trainer.save_checkpoint(root, step, metrics)
            final_step = step
            progress.update(1)
            progress.set_postfix(
                reward=f"{metrics['reward/score_mean']:.3f}", kl=f"{metrics['kl/token_k3']:.3f}"
            )
    selection = trainer.select(root)
    return FitResult(
        final_step=final_step,
        resumed_from=state.step,
        total_steps=trainer.total_steps,
        critic_pretrain_steps=trainer.pretrain_end if trainer.pretrain_end is not None else final_step,
        selection=selection,
        validations=list(trainer.validations),
        metrics=metrics,
        stop=stop,
    )
