"""The PPO policy as an MLflow pyfunc that answers OpenAI-style chat-completion requests.

`mlflow models serve -m models:/rlhf-policy@champion` hands each JSON request with a `messages` key to
`ChatPolicy.predict` unwrapped, and answers with what it returns, so one request gets one chat
completion object (not a list holding one):

    {"id": "chatcmpl-...", "object": "chat.completion", "created": ..., "model": "rlhf-policy/3",
     "choices": [{"index": 0, "message": {"role": "assistant", "content": "..."},
                  "finish_reason": "stop"}],
     "usage": {"prompt_tokens": ..., "completion_tokens": ..., "total_tokens": ...}}

- `model` names the registered model and version. The version exists only once the model is
  registered, after it was logged, so registration writes it into the logged model as
  `registered_model.json` (tasks/registry/registered_models.py, `record_registered_identity`); before that (a model
  loaded by its run) it is the registered name alone.
- `finish_reason` is "length" when the reply was cut at `max_tokens` before its end-of-turn token,
  "stop" when it ended there.
- The reply is sampled exactly as evaluation samples (rlhf_core/evaluation/generation.py: the model's
  chat template, stopping at the end-of-turn token; with transformers' `generate`, as the lean engine's
  weight copy per call would cost a single request more than it saves), with the request's `max_tokens` (default 256, or
  what the context leaves if less), `temperature` (0: greedy), `top_p` and `seed`; other fields are
  ignored (`stream` too: the answer is one object).
- A malformed request, or one that does not fit the model's context, is refused before any generation
  with an error naming the field and its bound, which the scoring server answers with 400
  (tasks/serving/chat_request.py lists the checks). Requests are generated one at a time (the scoring server
  runs each in a thread), so memory holds one request's KV cache, at most the model's context long.

The policy is logged as "models from code" (tasks/serving/chat_policy_code.py names this class), not as a
pickle: the stored model is the Hugging Face directory plus that one readable file. Loading it needs
this project installed, like the reward scorer (tasks/serving/reward_scorer.py).
"""

from __future__ import annotations

import json
import secrets
import threading
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import mlflow.pyfunc

from rlhf_core.config import RolloutConfig
from rlhf_core.evaluation.generation import Reply, generate_replies
from rlhf_core.models.chat import encode_prompt
from rlhf_core.models.loading import load_causal_lm
from tasks.serving.chat_request import ChatRequest, check_length, parse_request, reply_budget

POLICY_ARTIFACT = "policy"  # the pyfunc's artifact: the PPO model directory
MODEL_NAME_CONFIG = "registered_name"  # the pyfunc's model_config key: the name it is registered as
REGISTERED_FILE = "registered_model.json"  # in the logged policy: the name and version it was registered as
GREEDY_TEMPERATURE = 1e-6  # temperature 0 (greedy): softmax(logits / 1e-6) puts all mass on the argmax
SEED_RANGE = 2**31


def served_model_name(model_root: Path, model_config: dict[str, Any]) -> str:
    """`<name>/<version>` from the registered_model.json registration wrote, else the configured name."""
    identity = model_root / REGISTERED_FILE
    if identity.is_file():
        record = json.loads(identity.read_text(encoding="utf-8"))
        return f"{record['name']}/{record['version']}"
    return str(model_config.get(MODEL_NAME_CONFIG, POLICY_ARTIFACT))


def completion(model_name: str, reply: Reply, prompt_tokens: int) -> dict[str, Any]:
    """The OpenAI chat completion object of one reply."""
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model_name,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": reply.text},
                "finish_reason": "stop" if reply.finished else "length",
            }
        ],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": reply.tokens,
            "total_tokens": prompt_tokens + reply.tokens,
        },
    }


class ChatPolicy(mlflow.pyfunc.PythonModel):
    """pyfunc wrapper of a saved policy: one chat completion per request, one generation at a time."""

    def load_context(self, context: Any) -> None:
        directory = Path(context.artifacts[POLICY_ARTIFACT])
        self.model, self.tokenizer = load_causal_lm(directory)
        self.context_tokens = int(self.model.config.max_position_embeddings)
        # The artifact is <model root>/artifacts/policy; registration wrote the identity into the root.
        self.model_name = served_model_name(directory.parents[1], context.model_config or {})
        # The scoring server runs each request in a thread of its own: one generation at a time keeps
        # memory at one KV cache, and the seeded random state of one request apart from another's.
        self.generating = threading.Lock()

    # `model_input` has no type hint on purpose: MLflow would build an input schema from one, and it
    # accepts only list[...] hints, while the serving endpoint hands over one request as a dict.
    def predict(self, context: Any, model_input, params: dict[str, Any] | None = None) -> Any:
        """A completion for a request (a dict), a list of completions for a list of requests; a request
        that is malformed or does not fit the model is refused first (tasks/serving/chat_request.py)."""
        if isinstance(model_input, list):
            return [self.complete(parse_request(item)) for item in model_input]
        if not isinstance(model_input, Mapping):
            return self.complete(parse_request(model_input))  # refused, naming what came instead
        return self.complete(parse_request({**model_input, **(params or {})}))

    def complete(self, request: ChatRequest) -> dict[str, Any]:
        """Sample one reply to `request.messages`, at most as long as the context leaves room for."""
        check_length(request, self.context_tokens)
        messages = [message.model_dump() for message in request.messages]
        prompt_tokens = len(encode_prompt(self.tokenizer, messages))
        settings = RolloutConfig(
            engine="hf",
            max_new_tokens=reply_budget(request, prompt_tokens, self.context_tokens),
            temperature=request.temperature or GREEDY_TEMPERATURE,
            top_p=request.top_p,
        )
        seed = request.seed if request.seed is not None else secrets.randbelow(SEED_RANGE)
        with self.generating:
            (reply,) = generate_replies(self.model, self.tokenizer, [messages], settings, batch_size=1, seed=seed)
        return completion(self.model_name, reply, prompt_tokens)
