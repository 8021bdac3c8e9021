"""Validation on the held-out PPO prompts and the choice of the output policy (paper 5.2).

`Validator.sample` draws one response per held-out prompt with the rollout settings, each batch of
prompts from its own fixed seed, and `validate` reads the monitors off them: successive validations
differ only by the policy, prompt by prompt (paired), and training's random stream is not consumed. Each
validated policy is saved; at the end of the run `select` applies `selection.select_policy` and installs
the chosen one as `<root>/best/`.
"""

from __future__ import annotations

import shutil
import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from rlhf_core.atomic import atomic_directory
from rlhf_core.config import PPOConfig
from rlhf_core.distributed.context import RankContext
from rlhf_core.distributed.zero import gathered_parameters
from rlhf_core.models.chat import Messages, encode_prompt
from rlhf_core.models.saving import save_causal_lm
from rlhf_core.ppo.experience_maker import Batch, ExperienceMaker
from rlhf_core.ppo.monitors import Metrics, validation_monitors
from rlhf_core.ppo.recipe import penalize_unfinished
from rlhf_core.ppo.scoring import chunks
from rlhf_core.ppo.selection import Selection, ValidationRecord, select_policy
from rlhf_core.ppo.sequences import TrunkStates
from rlhf_core.rollout.generation import left_pad

BEST_DIR = "best"
VALIDATED_DIR = "validated"  # validated/step-<n>: every validated policy, until the selection


def validated_dir(root: Path, step: int) -> Path:
    """Where the policy validated after iteration `step` is kept until the selection."""
    return root / VALIDATED_DIR / f"step-{step}"


def _pad_columns(tensor: Tensor, width: int) -> Tensor:
    """Right-pad a ``[B, T]`` tensor with zeros to ``[B, width]``."""
    return F.pad(tensor, (0, width - tensor.shape[1]))


@dataclass(frozen=True)
class ValidationReplies:
    """One reply per held-out prompt, in the validator's prompt order: the reward model's scores and the
    finished flags ``[N]``, the policy's and the reference's log-probabilities and the response mask
    ``[N, T]``, and the seconds the sampling and scoring took."""

    scores: Tensor
    finished: Tensor
    logprobs: Tensor
    ref_logprobs: Tensor
    mask: Tensor
    seconds: float


class Validator:
    """The held-out prompts, the validations so far (checkpointed) and the selection."""

    def __init__(
        self,
        maker: ExperienceMaker,
        prompts: Sequence[Messages],
        names: Sequence[str],
        config: PPOConfig,
        seed: int,
        context: RankContext,
    ) -> None:
        self.maker = maker
        self.config = config
        self.seed = seed
        self.context = context
        names = list(names) or [str(index) for index in range(len(prompts))]
        tokenizer = maker.tokenizer
        encoded = sorted(  # by length: validation batches need little padding
            (
                (encode_prompt(tokenizer, messages, config.max_prompt_tokens), name)
                for messages, name in zip(prompts[: config.val_prompts], names)
            ),
            key=lambda item: len(item[0]),
        )
        if len(encoded) < 2:
            raise ValueError(
                f"PPO validation needs at least 2 held-out prompts (paired standard errors); got {len(encoded)}"
            )
        self.prompt_tokens = [tokens for tokens, _ in encoded]
        self.prompt_names = [name for _, name in encoded]  # in the order of every validation's rewards
        self.records: list[ValidationRecord] = []

    def _fixed_rng(self) -> AbstractContextManager[object]:
        """A random stream for validation that leaves the training stream untouched."""
        device = self.maker.device
        return torch.random.fork_rng(devices=[device] if device.type == "cuda" else [])

    def replies(self) -> Iterator[tuple[Batch, Batch, Tensor, TrunkStates | None]]:
        """The current policy's reply to every held-out prompt, a rollout batch at a time, each batch from
        its own fixed seed: ``(prompt, response, finished, trunk states)``."""
        maker = self.maker
        with self._fixed_rng():
            for index, rows in enumerate(chunks(len(self.prompt_tokens), self.config.rollout_batch_size)):
                torch.manual_seed(self.seed + index)
                prompt = left_pad(self.prompt_tokens[rows], maker.pad_id, maker.device)
                response_ids, mask, finished = maker.sample(prompt)
                response = (response_ids, mask)
                yield prompt, response, finished, maker.trunk_states(prompt, response)

    @torch.no_grad()
    def sample(self) -> ValidationReplies:
        """The current policy's replies to the held-out prompts with what the monitors read of them."""
        started = time.perf_counter()
        maker, models = self.maker, self.maker.models
        parts: dict[str, list[Tensor]] = defaultdict(list)
        for prompt, response, finished, trunk in self.replies():
            parts["logprobs"].append(maker.logprobs(models.policy, prompt, response, trunk))
            parts["ref_logprobs"].append(
                maker.logprobs(models.reference, prompt, response, maker.trunk_for("reference", trunk))
            )
            parts["scores"].append(maker.scores(prompt, response, maker.trunk_for("reward_model", trunk)))
            parts["finished"].append(finished)
            parts["mask"].append(response[1])
        width = max(mask.shape[1] for mask in parts["mask"])
        return ValidationReplies(
            scores=torch.cat(parts["scores"]),
            finished=torch.cat(parts["finished"]),
            logprobs=torch.cat([_pad_columns(t, width) for t in parts["logprobs"]]),
            ref_logprobs=torch.cat([_pad_columns(t, width) for t in parts["ref_logprobs"]]),
            mask=torch.cat([_pad_columns(t, width) for t in parts["mask"]]),
            seconds=time.perf_counter() - started,
        )

    def validate(self, replies: ValidationReplies | None = None) -> tuple[Metrics, list[float]]:
        """Monitors on the held-out prompts (`val/...`) and the reward of each prompt, of `replies` or,
        by default, of a fresh `sample`.

        A prompt's reward is what training optimises, less the KL term: the reward model's score plus
        `unfinished_penalty` when the response was cut.
        """
        replies = replies if replies is not None else self.sample()
        rewards = penalize_unfinished(replies.scores, replies.finished, self.config.unfinished_penalty)
        metrics = validation_monitors(
            rewards=rewards,
            scores=replies.scores,
            finished=replies.finished,
            logprobs=replies.logprobs,
            ref_logprobs=replies.ref_logprobs,
            mask=replies.mask,
        )
        return {**metrics, "time/validate_s": replies.seconds}, rewards.tolist()

    def record(self, step: int, validation: Metrics, rewards: list[float], root: Path) -> None:
        """Keep this validation's per-prompt rewards and save the policy to `root/validated/step-<step>`."""
        policy = self.maker.models.policy
        with gathered_parameters(policy):  # every rank alike; rank 0 writes
            if self.context.is_main:
                save_causal_lm(policy, self.maker.tokenizer, validated_dir(root, step))
        self.records.append(ValidationRecord(step=step, kl=validation["val/kl"], rewards=tuple(rewards)))

    def select(self, root: Path) -> Selection:
        """Apply `selection.select_policy` to the validations and install the chosen policy as `best/`."""
        selection = select_policy(self.records, self.config.guard.max_kl)
        if self.context.is_main:
            with atomic_directory(root / BEST_DIR) as temporary:
                shutil.copytree(validated_dir(root, selection.step), temporary, dirs_exist_ok=True)
        return selection

    def state_dict(self) -> dict[str, object]:
        return {"validations": [record.to_dict() for record in self.records]}

    def load_state_dict(self, state: dict[str, object]) -> None:
        self.records = [ValidationRecord.from_dict(record) for record in state["validations"]]  # type: ignore[union-attr]
