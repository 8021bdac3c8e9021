"""The reward-model judge: both replies scored by a reward model, the higher score wins.

A reply is scored exactly as in training and in PPO: the conversation goes through
`chat.encode_conversation` and `RewardModel.forward` reads r(x, y) at `chat.reply_end_positions` (the
one function that finds where a reply ends). Sequences are scored whole, without truncation: the
evaluation prompts were length-filtered by `data.max_total_tokens` and the replies are bounded by
`evaluation.generation.max_new_tokens`.

A margin r(x, y_A) - r(x, y_B) within +-`tie_margin` is a tie (with the default 0, only equal scores
tie). The reward model PPO optimised against is an IN-SAMPLE judge: the policy learned to please
exactly this model, so the report flags it, and a second reward model trained on a disjoint split is
the better judge (stages/judge_reward.py); the report says what a judge was trained on when its
directory holds training_data.json (rlhf_core/reward/training_data.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from rlhf_core.data.records import Message
from rlhf_core.evaluation.judges.verdicts import EvalPair, JudgeInfo, Judgement, Verdict
from rlhf_core.evaluation.model_dirs import REWARD_MODEL_MARKER, resolve_model_dir
from rlhf_core.models.chat import encode_conversation
from rlhf_core.models.heads import RewardModel
from rlhf_core.models.loading import load_tokenizer
from rlhf_core.progress import progress
from rlhf_core.reward.training_data import RewardTrainingData, read_training_data
from rlhf_core.sft.batch import collate_sequences


def margin_verdict(margin: float, tie_margin: float) -> Verdict:
    """A if the margin r_A - r_B exceeds `tie_margin`, B if it is below -`tie_margin`, else a tie."""
    if margin > tie_margin:
        return Verdict.A
    if margin < -tie_margin:
        return Verdict.B
    return Verdict.TIE


@torch.no_grad()
def score_replies(
    reward_model: RewardModel,
    tokenizer: PreTrainedTokenizerBase,
    conversations: Sequence[tuple[Sequence[Message], str]],
    batch_size: int,
) -> np.ndarray:
    """r(x, y) [N] of each (prompt, reply), in the order given, `batch_size` conversations per forward pass
    (a progress bar counts the replies scored).

    The batches are cut from the conversations sorted by length, so each pass pads to a near neighbour's
    length rather than to the longest of a random few: an evaluation's policy and SFT replies differ in
    length, and in input order a quarter of the judge's token passes were padding (docs/stage-bounds.md).
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    device = next(reward_model.parameters()).device
    encoded = [encode_conversation(tokenizer, prompt, reply) for prompt, reply in conversations]
    order = sorted(range(len(encoded)), key=lambda index: len(encoded[index].input_ids))
    scores = torch.zeros(len(encoded), dtype=torch.float64)
    with progress(len(encoded), "rm judge", "reply") as scored:
        for start in range(0, len(order), batch_size):
            indices = order[start : start + batch_size]
            batch = collate_sequences([encoded[index] for index in indices], tokenizer.pad_token_id).to(device)
            output = reward_model(batch.input_ids, batch.attention_mask, reply_start=batch.reply_start)
            scores[indices] = output.scores.float().cpu().double()
            scored.advance(len(indices))
    return scores.numpy()


class RewardModelJudge:
    """Scores both replies of each pair with one reward model; see the module docstring."""

    def __init__(
        self,
        reward_model: RewardModel,
        tokenizer: PreTrainedTokenizerBase,
        tie_margin: float,
        batch_size: int,
        source: str,
        in_sample: bool,
        training_data: RewardTrainingData | None = None,
    ) -> None:
        if tie_margin < 0:
            raise ValueError(f"tie_margin must be >= 0, got {tie_margin}")
        self.reward_model = reward_model
        self.tokenizer = tokenizer
        self.tie_margin = tie_margin
        self.batch_size = batch_size
        self.source = source
        self.in_sample = in_sample
        self.training_data = training_data
        self._pairs_judged = 0

    @classmethod
    def from_directory(
        cls,
        rm_dir: str | Path,
        tie_margin: float,
        batch_size: int,
        in_sample: bool,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> RewardModelJudge:
        """Load the reward model of a train-rm output directory (or of a saved reward-model directory)."""
        model_dir = resolve_model_dir(rm_dir, REWARD_MODEL_MARKER)
        reward_model = RewardModel.from_pretrained(model_dir, dtype=dtype, device=device)
        return cls(
            reward_model,
            load_tokenizer(model_dir),
            tie_margin,
            batch_size,
            str(rm_dir),
            in_sample,
            read_training_data(Path(rm_dir)),
        )

    def judge(self, pairs: Sequence[EvalPair]) -> list[Judgement]:
        """One verdict per pair from the score margin; the scores go into the detail.

        Each distinct (prompt, reply) is scored once, so two identical replies get the identical score
        and tie: scored in different batches, padding would change their scores in the last bits.
        """
        conversations: dict[tuple[str, str], tuple[Sequence[Message], str]] = {}
        for pair in pairs:
            for reply in (pair.reply_a, pair.reply_b):
                conversations.setdefault((pair.prompt_id, reply), (pair.prompt, reply))
        scored = score_replies(self.reward_model, self.tokenizer, list(conversations.values()), self.batch_size)
        score_of = dict(zip(conversations, scored.tolist()))
        scores_a = [score_of[(pair.prompt_id, pair.reply_a)] for pair in pairs]
        scores_b = [score_of[(pair.prompt_id, pair.reply_b)] for pair in pairs]
        self._pairs_judged += len(pairs)
        return [
            Judgement(
                verdict=margin_verdict(a - b, self.tie_margin), detail={"score_a": a, "score_b": b, "margin": a - b}
            )
            for a, b in zip(scores_a, scores_b)
        ]

    def info(self) -> JudgeInfo:
        """The reward model's location, the tie margin, whether it is the in-sample judge, and what it was
        trained on when its directory says."""
        if self.in_sample:
            sample = "IN-SAMPLE: taken to be the reward model PPO optimised against, so it favours the PPO policy"
        elif self.training_data is not None:
            sample = f"independent reward model ({self.training_data.describe()})"
        else:
            sample = "independent of the reward model PPO optimised against"
        return JudgeInfo(
            kind="rm",
            name=f"reward model {self.source}",
            role=reward_model_role(self.in_sample, self.training_data),
            description=f"reward model {self.source} (tie margin {self.tie_margin:g}; {sample})",
            in_sample=self.in_sample,
            figures={"pairs_judged": float(self._pairs_judged), "tie_margin": self.tie_margin},
        )


def reward_model_role(in_sample: bool, training_data: RewardTrainingData | None) -> str:
    """Which reward model judged, as the run summary and report.md say it: the in-sample one (PPO's own,
    biased), the independent judge (the judge-rm stage's, trained on the PPO-prompt split), or another
    reward model that is not PPO's own (e.g. another run's)."""
    if in_sample:
        return "the in-sample reward model (IN-SAMPLE: the one PPO optimised against)"
    if training_data is not None and training_data.train_split == "ppo_pairs":
        return "the independent judge reward model"
    return "a reward model other than the one PPO optimised against"
