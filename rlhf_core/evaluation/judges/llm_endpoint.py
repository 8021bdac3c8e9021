"""Where the LLM judge sends its requests: an OpenAI-compatible endpoint named by environment variables.

    RLHF_JUDGE_API_KEY    the API key (falls back to OPENAI_API_KEY); required
    RLHF_JUDGE_BASE_URL   the API's base URL, e.g. http://localhost:8000/v1 for a local vLLM server
                          (falls back to OPENAI_BASE_URL, then to OpenAI's own API)
    RLHF_JUDGE_MODEL      the judge model (falls back to `evaluation.llm_model` in params.yaml)

The key is held only in memory: it is left out of the endpoint's repr, and nothing in the evaluation
writes or logs it (the tests scan every output file and log line for it).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

API_KEY_VARIABLES = ("RLHF_JUDGE_API_KEY", "OPENAI_API_KEY")
BASE_URL_VARIABLES = ("RLHF_JUDGE_BASE_URL", "OPENAI_BASE_URL")
MODEL_VARIABLE = "RLHF_JUDGE_MODEL"
OPENAI_BASE_URL = "https://api.openai.com/v1"


class LlmEndpointError(RuntimeError):
    """No LLM endpoint is configured; the message names the variables to set."""


@dataclass(frozen=True)
class LlmEndpoint:
    """Base URL, model and API key of the judge's chat-completions API."""

    base_url: str
    model: str
    api_key: str = field(repr=False)

    @classmethod
    def from_environment(cls, default_model: str, environ: Mapping[str, str] | None = None) -> LlmEndpoint:
        """Read the endpoint from the variables in the module docstring; fail clearly if no key is set."""
        environ = os.environ if environ is None else environ
        api_key = _first_set(environ, API_KEY_VARIABLES)
        if api_key is None:
            raise LlmEndpointError(
                "the LLM judge needs an OpenAI-compatible endpoint: set RLHF_JUDGE_API_KEY (or "
                "OPENAI_API_KEY), and RLHF_JUDGE_BASE_URL for a server other than OpenAI's and "
                "RLHF_JUDGE_MODEL for a model other than evaluation.llm_model; or judge with the "
                "reward model (--judge rm)"
            )
        base_url = _first_set(environ, BASE_URL_VARIABLES) or OPENAI_BASE_URL
        model = _first_set(environ, (MODEL_VARIABLE,)) or default_model
        return cls(base_url=base_url.rstrip("/"), model=model, api_key=api_key)


def _first_set(environ: Mapping[str, str], names: tuple[str, ...]) -> str | None:
    """The value of the first variable in `names` that is set to something other than whitespace."""
    for name in names:
        value = environ.get(name, "").strip()
        if value:
            return value
    return None
