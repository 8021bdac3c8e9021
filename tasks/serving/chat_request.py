"""What the served policy accepts (tasks/serving/chat_policy.py): a typed chat request, checked against its context.

Why: `mlflow models serve` hands each request body to `ChatPolicy.predict` as parsed JSON, and any
exception there becomes a 400 saying only "Encountered an unexpected error while evaluating the
model"; and what is not refused is generated: a `max_tokens` of a billion on a policy that never says
its end-of-turn token grows its KV cache for as long as the process lives (the server's request
timeout answers 504 but does not stop the thread). So every request is checked before any
generation, and refused with a `ChatRequestError`, an MlflowException that the scoring server answers
with 400 and this message, naming the field and its bound:

- the body is a JSON object with `messages`: a non-empty list of `{"role": "system" | "user" |
  "assistant", "content": <string>}`; types are strict (`"8"` is not a number, `true` not an integer);
- `max_tokens`: an integer >= 1; `temperature`: a number in [0, 2]; `top_p`: in (0, 1]; `seed`: an
  integer in [0, 2**63); other fields (`model`, `stream`, ...) are ignored;
- the prompt, rendered by the chat template, must leave room in the model's context
  (`max_position_embeddings`) for a reply: `max_tokens` may be at most the room left, and a request
  without it gets DEFAULT_MAX_TOKENS or the room left, whichever is less;
- messages longer than CHARACTERS_PER_TOKEN characters per context token are refused before they are
  tokenised, so an oversized body costs no tokeniser time.
"""

from __future__ import annotations

from typing import Any, Literal

from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE
from pydantic import BaseModel, ConfigDict, Field, ValidationError

DEFAULT_MAX_TOKENS = 256
SEED_LIMIT = 2**63
# A token of the project's tokenisers is a few characters on average and rarely over 16; a prompt
# with more than 32 characters per context token cannot fit.
CHARACTERS_PER_TOKEN = 32


class ChatRequestError(MlflowException):
    """A request the policy refuses: the message names the field and its bound (HTTP 400 when served)."""

    def __init__(self, message: str) -> None:
        super().__init__(f"invalid chat request: {message}", error_code=INVALID_PARAMETER_VALUE)


class ChatMessage(BaseModel):
    """One message of the conversation."""

    model_config = ConfigDict(extra="ignore", strict=True)

    role: Literal["system", "user", "assistant"]
    content: str


class ChatRequest(BaseModel):
    """The OpenAI chat-completions fields the policy honours; other fields (`model`, `stream`: false, ...)
    are ignored."""

    model_config = ConfigDict(extra="ignore", strict=True)

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, lt=SEED_LIMIT)


def parse_request(payload: Any) -> ChatRequest:
    """`payload` (parsed JSON) as a ChatRequest, or a ChatRequestError naming each bad field (by its path,
    e.g. `messages.0.content`) and what it should be; the offending values are not echoed."""
    if not isinstance(payload, dict):
        raise ChatRequestError(f"expected a JSON object with messages, got {type(payload).__name__}")
    try:
        return ChatRequest.model_validate(payload)
    except ValidationError as error:
        problems = [
            f"{'.'.join(map(str, problem['loc'])) or 'request'}: {problem['msg']}" for problem in error.errors()
        ]
        raise ChatRequestError("; ".join(problems)) from None


def check_length(request: ChatRequest, context: int) -> None:
    """Refuse messages too long to tokenise for a model that reads `context` tokens (module docstring)."""
    characters = sum(len(message.content) for message in request.messages)
    if characters > CHARACTERS_PER_TOKEN * context:
        raise ChatRequestError(
            f"messages: {characters} characters cannot fit this model's context of {context} tokens "
            f"(at most {CHARACTERS_PER_TOKEN * context} characters are read)"
        )


def reply_budget(request: ChatRequest, prompt_tokens: int, context: int) -> int:
    """How many tokens the reply may have: `max_tokens`, or DEFAULT_MAX_TOKENS, within the room the
    `prompt_tokens`-token prompt leaves in the `context`; a ChatRequestError when it does not fit."""
    room = context - prompt_tokens
    if room < 1:
        raise ChatRequestError(
            f"messages: the prompt is {prompt_tokens} tokens, and this model's context is {context} tokens, "
            "prompt and reply together"
        )
    if request.max_tokens is None:
        return min(DEFAULT_MAX_TOKENS, room)
    if request.max_tokens > room:
        raise ChatRequestError(
            f"max_tokens: {request.max_tokens} is more than the {room} tokens a reply may have after this "
            f"{prompt_tokens}-token prompt (the model's context is {context} tokens)"
        )
    return request.max_tokens
