"""The served chat policy under bad input and load: refused with 400 and a message naming the
field and its bound, never a crash, never a generation longer than the model's context.

- `parse_request`: missing fields, wrong types (strict: "8" and true are not integers), out-of-range
  values and a body that is not an object each name the field; `reply_budget`: a prompt that fills
  the context and a `max_tokens` beyond the room left are refused naming the limit, and a request
  without `max_tokens` is clamped to the room left.
- `ChatPolicy` in this process on a tiny random model (context 2048): a billion `max_tokens` and an
  oversized prompt are refused before any generation; a long prompt without `max_tokens` gets a reply
  that ends within the context.
- MLflow's scoring server (what `mlflow models serve` runs), in this process: malformed JSON, missing
  and mistyped fields and a huge `max_tokens` get 400 with the reason; a good request gets 200.
- Slow: `mlflow models serve` on the saved model under scripts/serve_load.py's load: two bursts
  of 200 requests, all 200 in flight at once, a quarter of them malformed, oversized or out of range:
  every good one answered with a chat completion, every bad one refused with 400, the server still up,
  and its process tree's resident memory after the second burst within MEMORY_ROUND_BOUND_MIB of the
  first (memory that grows with each burst fails) and within MEMORY_BOUND_MIB of where it started
  (measured: +48 MiB after the first burst, +5 after the second, on the tiny model).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import mlflow
import pytest
from mlflow.pyfunc.scoring_server import init as scoring_app
from starlette.testclient import TestClient

from fixtures.paths import ROOT
from rlhf_core.config import ModelConfig
from rlhf_core.models.base import load_base_model
from rlhf_core.models.saving import save_causal_lm
from rlhf_core.models.tiny import TINY_MAX_POSITIONS
from tasks.registry.registered_models import CHAT_POLICY_CODE
from tasks.serving.chat_policy import POLICY_ARTIFACT, ChatPolicy
from tasks.serving.chat_request import ChatRequestError, parse_request, reply_budget

HELLO = [{"role": "user", "content": "Say hello."}]
GOOD = {"messages": HELLO, "max_tokens": 4, "temperature": 0}
LOAD_TIMEOUT_S = 900  # a guard for a hung server, not a measurement
LOAD_REQUESTS = 200  # per burst, all in flight at once (the figure)
MEMORY_BOUND_MIB = 256  # the server's RSS growth over both bursts
MEMORY_ROUND_BOUND_MIB = 64  # its growth from the first burst's end to the second's

# (request, the words the refusal must hold)
BAD_REQUESTS: list[tuple[Any, str]] = [
    ({}, "messages: Field required"),
    ({"messages": "hello"}, "messages: Input should be a valid list"),
    ({"messages": []}, "messages: List should have at least 1 item"),
    ({"messages": [{"role": "user"}]}, "messages.0.content: Field required"),
    ({"messages": [{"role": "user", "content": 123}]}, "messages.0.content: Input should be a valid string"),
    (
        {"messages": [{"role": "robot", "content": "hi"}]},
        "messages.0.role: Input should be 'system', 'user' or 'assistant'",
    ),
    ({"messages": HELLO, "max_tokens": "8"}, "max_tokens: Input should be a valid integer"),
    ({"messages": HELLO, "max_tokens": True}, "max_tokens: Input should be a valid integer"),
    ({"messages": HELLO, "max_tokens": 0}, "max_tokens: Input should be greater than or equal to 1"),
    ({"messages": HELLO, "temperature": 3}, "temperature: Input should be less than or equal to 2"),
    ({"messages": HELLO, "temperature": "hot"}, "temperature: Input should be a valid number"),
    ({"messages": HELLO, "top_p": 0}, "top_p: Input should be greater than 0"),
    ({"messages": HELLO, "seed": -1}, "seed: Input should be greater than or equal to 0"),
    ({"messages": HELLO, "seed": 2**64}, "seed: Input should be less than 9223372036854775808"),
    (["not", "an", "object"], "expected a JSON object with messages, got list"),
]


@pytest.mark.parametrize(("request_body", "words"), BAD_REQUESTS)
def test_a_malformed_request_is_refused_naming_the_field(request_body: Any, words: str) -> None:
    with pytest.raises(ChatRequestError) as refused:
        parse_request(request_body)
    assert refused.value.message.startswith("invalid chat request: ")
    assert words in refused.value.message
    assert refused.value.get_http_status_code() == 400


def test_the_reply_must_fit_the_context() -> None:
    asked = parse_request({"messages": HELLO, "max_tokens": 100})
    assert reply_budget(asked, prompt_tokens=20, context=2048) == 100
    assert reply_budget(parse_request({"messages": HELLO}), prompt_tokens=20, context=2048) == 256
    assert reply_budget(parse_request({"messages": HELLO}), prompt_tokens=2000, context=2048) == 48  # clamped
    with pytest.raises(
        ChatRequestError,
        match=r"max_tokens: 100 is more than the 48 tokens a reply may have after this 2000-token prompt "
        r"\(the model's context is 2048 tokens\)",
    ):
        reply_budget(asked, prompt_tokens=2000, context=2048)
    with pytest.raises(
        ChatRequestError, match=r"messages: the prompt is 2048 tokens, and this model's context is 2048 tokens"
    ):
        reply_budget(asked, prompt_tokens=2048, context=2048)


@pytest.fixture(scope="module")
def saved_policy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random policy saved as the chat pyfunc, from code, as registration logs it
    (tasks/registry/registered_models.py)."""
    root = tmp_path_factory.mktemp("policy")
    save_causal_lm(*load_base_model(ModelConfig(kind="tiny")), root / "model")
    mlflow.pyfunc.save_model(
        root / "pyfunc",
        python_model=str(CHAT_POLICY_CODE),
        artifacts={POLICY_ARTIFACT: str(root / "model")},
        metadata={"task": "llm/v1/chat"},
        pip_requirements=["mlflow"],
    )
    return root / "pyfunc"


@pytest.fixture(scope="module")
def policy(saved_policy: Path) -> ChatPolicy:
    chat = ChatPolicy()
    chat.load_context(
        SimpleNamespace(artifacts={POLICY_ARTIFACT: str(saved_policy / "artifacts" / "model")}, model_config={})
    )
    return chat


def test_huge_max_tokens_and_an_oversized_prompt_are_refused_before_generating(
    policy: ChatPolicy, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tasks.serving.chat_policy

    monkeypatch.setattr(tasks.serving.chat_policy, "generate_replies", pytest.fail)  # nothing may be generated
    assert policy.context_tokens == TINY_MAX_POSITIONS
    with pytest.raises(ChatRequestError, match=r"max_tokens: 1000000000 is more than the \d+ tokens a reply may have"):
        policy.predict(None, {"messages": HELLO, "max_tokens": 10**9})
    words = {"messages": [{"role": "user", "content": "hello " * 3000}]}  # ~3000 tokens
    with pytest.raises(ChatRequestError, match=r"messages: the prompt is \d+ tokens, and this model's context is 2048"):
        policy.predict(None, words)
    flood = {"messages": [{"role": "user", "content": "x" * (32 * 2048 + 1)}]}
    with pytest.raises(
        ChatRequestError, match=r"messages: 65537 characters cannot fit this model's context of 2048 tokens"
    ):
        policy.predict(None, flood)


def test_a_long_prompt_without_max_tokens_is_answered_within_the_context(policy: ChatPolicy) -> None:
    reply = policy.predict(None, {"messages": [{"role": "user", "content": "hello " * 2000}], "seed": 1})
    usage = reply["usage"]
    assert usage["prompt_tokens"] > 2000 and usage["total_tokens"] <= TINY_MAX_POSITIONS
    assert reply["choices"][0]["finish_reason"] in {"stop", "length"}


@pytest.fixture(scope="module")
def scoring_client(saved_policy: Path) -> TestClient:
    """MLflow's scoring server app (what `mlflow models serve` runs) on the saved policy, in this process."""
    return TestClient(scoring_app(mlflow.pyfunc.load_model(str(saved_policy))))


def test_the_scoring_server_answers_bad_requests_with_400_and_the_reason(scoring_client: TestClient) -> None:
    malformed = scoring_client.post(
        "/invocations", content=b'{"messages": [', headers={"content-type": "application/json"}
    )
    assert malformed.status_code == 400 and "valid JSON" in malformed.json()["message"]
    for body, words in BAD_REQUESTS[3:-1]:  # with `messages`: the policy's own checks decide
        response = scoring_client.post("/invocations", json=body)
        assert response.status_code == 400, (body, response.text)
        assert words in response.json()["message"]
    huge = scoring_client.post("/invocations", json={"messages": HELLO, "max_tokens": 10**9})
    assert huge.status_code == 400 and "max_tokens: 1000000000 is more than" in huge.json()["message"]
    good = scoring_client.post("/invocations", json=GOOD)
    assert good.status_code == 200, good.text
    assert good.json()["object"] == "chat.completion" and good.json()["usage"]["completion_tokens"] <= 4


def serve_load_script() -> Any:
    """scripts/serve_load.py as a module (scripts/ is a folder of scripts, not a package)."""
    spec = importlib.util.spec_from_file_location("serve_load", ROOT / "scripts" / "serve_load.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def test_the_load_mixes_every_kind_of_bad_request_in_a_seeded_order() -> None:
    serve_load = serve_load_script()
    sent = serve_load.probes(200, 0.25, 8, seed=0)
    assert len(sent) == 200 and sum(not probe.good for probe in sent) == 50
    assert {probe.kind for probe in sent if not probe.good} == set(serve_load.BAD_KINDS)
    assert sent == serve_load.probes(200, 0.25, 8, seed=0) and sent != serve_load.probes(200, 0.25, 8, seed=1)
    for probe in sent:
        if probe.good:
            assert parse_request(json.loads(probe.body)).max_tokens == 8


@pytest.mark.slow  # starts `mlflow models serve`
def test_mlflow_models_serve_answers_200_concurrent_good_and_bad_requests_in_bounded_memory(
    saved_policy: Path, tmp_path: Path
) -> None:
    figures_file = tmp_path / "load.json"
    command = [sys.executable, str(ROOT / "scripts" / "serve_load.py"), "--model", str(saved_policy),
               "--requests", str(LOAD_REQUESTS), "--concurrency", str(LOAD_REQUESTS), "--bad-fraction", "0.25",
               "--max-tokens", "4", "--rounds", "2", "--json", str(figures_file)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # the server loads this checkout's tasks.serving.chat_policy
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=LOAD_TIMEOUT_S)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    figures = json.loads(figures_file.read_text())
    assert (figures["good"], figures["bad"]) == (300, 100)
    assert figures["by_status"] == {"200": 300, "400": 100} and figures["failures"] == []
    assert figures["server_alive"]
    memory = figures["memory_mib"]
    first, second = memory["after_each_round"]
    assert second - first < MEMORY_ROUND_BOUND_MIB, memory
    assert second - memory["before"] < MEMORY_BOUND_MIB, memory
