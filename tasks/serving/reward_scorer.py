"""The reward model as an MLflow pyfunc: score (conversation, reply) pairs with r(x, y).

A reward model directory is a backbone plus a scalar head (rlhf_core/models/saving.py), which no
MLflow flavour knows, so it is registered as a Python model whose artifact is that directory. The
input is a list of `{"messages": [...], "reply": "..."}` (the prompt as chat messages ending with a
user turn, and the candidate assistant reply); the output is one score per item, computed exactly
as reward-model training and PPO compute it: the conversation rendered through the chat template,
the score read at the reply's end-of-turn token.

It is logged from code (tasks/serving/reward_scorer_code.py builds the instance), so the logged model holds
no pickle. Loading it needs this project installed (`rlhf_core`, `tasks`), as serving it with
`mlflow models serve --env-manager local` from the project's environment does.
"""

from __future__ import annotations

from typing import Any

import mlflow.pyfunc
import torch
from pydantic import BaseModel

from rlhf_core.models.chat import encode_conversation
from rlhf_core.models.heads import RewardModel
from rlhf_core.models.loading import load_tokenizer

MODEL_ARTIFACT = "reward_model"


class ScoreRequest(BaseModel):
    """One conversation to score: the prompt messages and the assistant reply to judge."""

    messages: list[dict[str, str]]
    reply: str


class RewardScorer(mlflow.pyfunc.PythonModel):
    """pyfunc wrapper of a saved reward model; scores one conversation at a time (CPU serving)."""

    def load_context(self, context: Any) -> None:
        directory = context.artifacts[MODEL_ARTIFACT]
        self.model = RewardModel.from_pretrained(directory)
        self.tokenizer = load_tokenizer(directory)

    def predict(
        self, context: Any, model_input: list[ScoreRequest], params: dict[str, Any] | None = None
    ) -> list[float]:
        return [self.score(request) for request in model_input]

    @torch.no_grad()
    def score(self, request: ScoreRequest) -> float:
        """r(x, y) of one conversation (input_ids [1, T], no padding)."""
        encoded = encode_conversation(self.tokenizer, request.messages, request.reply)
        input_ids = torch.tensor([encoded.input_ids])
        output = self.model(input_ids, torch.ones_like(input_ids), encoded.reply_start)
        return float(output.scores[0])
