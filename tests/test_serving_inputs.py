"""The served chat policy under bad input and load (issue 30): refused with 400 and a message naming the
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
- Slow: `mlflow models serve` on the saved model, with a burst of 50 good requests and 10 bad ones
  from 16 threads: every good one answered, every bad one 400, and the server still up.
"""

from __future__ import annotations

import json
import os
import sys
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import mlflow
import pytest
from fixtures.servers import free_port, http_status, start_server, stop_server, wait_until_ready
from mlflow.pyfunc.scoring_server import init as scoring_app
from starlette.testclient import TestClient

from rlhf_core.config import ModelConfig
from rlhf_core.models.base import load_base_model
from rlhf_core.models.saving import save_causal_lm
from rlhf_core.models.tiny import TINY_MAX_POSITIONS
from tasks.chat_policy import ChatPolicy
from tasks.chat_request import ChatRequestError, parse_request, reply_budget
from tasks.registry import CHAT_POLICY_CODE, POLICY_ARTIFACT

HELLO = [{"role": "user", "content": "Say hello."}]
GOOD = {"messages": HELLO, "max_tokens": 4, "temperature": 0}
SERVE_START_TIMEOUT_S = 240

# (request, the words the refusal must hold)
BAD_REQUESTS: list[tuple[Any, str]] = [
    ({}, "messages: Field required"),
    ({"messages": "hello"}, "messages: Input should be a valid list"),
    ({"messages": []}, "messages: List should have at least 1 item"),
    ({"messages": [{"role": "user"}]}, "messages.0.content: Field required"),
    ({"messages": [{"role": "user", "content": 123}]}, "messages.0.content: Input should be a valid string"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages.0.role: Input should be 'system', 'user' or 'assistant'"),
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
    with pytest.raises(ChatRequestError, match=r"max_tokens: 100 is more than the 48 tokens a reply may have after this 2000-token prompt \(the model's context is 2048 tokens\)"):
        reply_budget(asked, prompt_tokens=2000, context=2048)
    with pytest.raises(ChatRequestError, match=r"messages: the prompt is 2048 tokens, and this model's context is 2048 tokens"):
        reply_budget(asked, prompt_tokens=2048, context=2048)


@pytest.fixture(scope="module")
def saved_policy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random policy saved as the chat pyfunc, from code, as registration logs it (tasks/registry.py)."""
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
    chat.load_context(SimpleNamespace(artifacts={POLICY_ARTIFACT: str(saved_policy / "artifacts" / "model")}, model_config={}))
    return chat


def test_huge_max_tokens_and_an_oversized_prompt_are_refused_before_generating(
    policy: ChatPolicy, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tasks.chat_policy

    monkeypatch.setattr(tasks.chat_policy, "generate_replies", pytest.fail)  # nothing may be generated
    assert policy.context_tokens == TINY_MAX_POSITIONS
    with pytest.raises(ChatRequestError, match=r"max_tokens: 1000000000 is more than the \d+ tokens a reply may have"):
        policy.predict(None, {"messages": HELLO, "max_tokens": 10**9})
    words = {"messages": [{"role": "user", "content": "hello " * 3000}]}  # ~3000 tokens
    with pytest.raises(ChatRequestError, match=r"messages: the prompt is \d+ tokens, and this model's context is 2048"):
        policy.predict(None, words)
    flood = {"messages": [{"role": "user", "content": "x" * (32 * 2048 + 1)}]}
    with pytest.raises(ChatRequestError, match=r"messages: 65537 characters cannot fit this model's context of 2048 tokens"):
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
    malformed = scoring_client.post("/invocations", content=b'{"messages": [', headers={"content-type": "application/json"})
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


def post(url: str, body: bytes) -> tuple[int, dict[str, Any]]:
    """POST `body` as JSON; the status and the decoded answer."""
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


@pytest.mark.slow  # starts `mlflow models serve`
def test_mlflow_models_serve_answers_a_burst_of_good_and_bad_requests(saved_policy: Path, tmp_path: Path) -> None:
    port = free_port()
    command = [sys.executable, "-m", "mlflow", "models", "serve", "-m", str(saved_policy), "--env-manager", "local",
               "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
    server = start_server("mlflow models serve", command, dict(os.environ), tmp_path / "serve.log")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_ready(server, lambda: http_status(f"{url}/ping") == 200, SERVE_START_TIMEOUT_S)
        good = [json.dumps({**GOOD, "seed": number}).encode() for number in range(50)]
        bad = [json.dumps(body).encode() for body, _ in BAD_REQUESTS[3:13]] + [b'{"messages": [']
        with ThreadPoolExecutor(max_workers=16) as pool:
            answers = list(pool.map(lambda body: post(f"{url}/invocations", body), good + bad))
        for status, answer in answers[: len(good)]:
            assert status == 200 and answer["object"] == "chat.completion", answer
        assert [status for status, _ in answers[len(good) :]] == [400] * len(bad)
        assert http_status(f"{url}/ping") == 200 and server.process.poll() is None
    finally:
        stop_server(server)
