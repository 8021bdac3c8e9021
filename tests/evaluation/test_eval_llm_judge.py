"""The LLM judge through the real `openai` client against a scripted OpenAI-compatible server on 127.0.0.1.

The server answers by a rule: the reply containing "GOOD" is better (a tie when both or neither do).
Markers in the prompt change its behaviour: POSITION_BIAS (always prefers the first reply), RATE_LIMITED
and SERVER_ERROR (the first request of each distinct body gets 429 / 500), ALWAYS_500, MALFORMED_FIRST
(no verdict until asked again), MALFORMED_ALWAYS (never a verdict), CONTRADICT (two different verdicts).
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import pytest

from fixtures.paths import PARAMS, TINY
from rlhf_core.config import load_config
from rlhf_core.evaluation.judges.llm import LlmJudge, LlmJudgeError, backoff_delay
from rlhf_core.evaluation.judges.llm_endpoint import LlmEndpoint, LlmEndpointError
from rlhf_core.evaluation.judges.llm_prompt import SlotVerdict, parse_verdict
from rlhf_core.evaluation.judges.verdicts import EvalPair, Verdict

API_KEY = "sk-test-SECRET-0123456789abcdef"
PROMPT_TOKENS, COMPLETION_TOKENS = 100, 10
SIMULTANEOUS_LIMIT = 3


@dataclass
class ServerState:
    requests: int = 0
    in_flight: int = 0
    max_in_flight: int = 0
    attempts_by_body: Counter[str] = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)


def scripted_answer(messages: list[dict[str, str]]) -> str:
    """The judge's answer by the rule in the module docstring."""
    question = messages[1]["content"]
    first = question.split("[Reply 1]")[1].split("[Reply 2]")[0]
    second = question.split("[Reply 2]")[1].split("Explain your reasoning")[0]
    reasked = len(messages) > 2
    if "MALFORMED_ALWAYS" in question or ("MALFORMED_FIRST" in question and not reasked):
        return "Both replies have merits; I find the first one a little nicer."
    if "CONTRADICT" in question:
        return "Reply 1 is clearer. [[1]]\nOn reflection: [[2]]"
    if "POSITION_BIAS" in question:
        return "The first reply is better.\n[[1]]"
    verdict = "tie"
    if "GOOD" in first and "GOOD" not in second:
        verdict = "1"
    elif "GOOD" in second and "GOOD" not in first:
        verdict = "2"
    return f"Reasoning in one sentence.\nVerdict: [[{verdict}]]"


def make_handler(state: ServerState) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: object) -> None:  # keep test output quiet
            pass

        def _send(self, status: int, payload: dict) -> None:
            # Out of flight before the reply is written: the client may start its next request as soon as
            # it has this reply, and that request must not count beside this one.
            with state.lock:
                state.in_flight -= 1
            body = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self) -> None:
            raw = self.rfile.read(int(self.headers["Content-Length"]))
            with state.lock:
                state.requests += 1
                state.in_flight += 1
                state.max_in_flight = max(state.max_in_flight, state.in_flight)
                digest = hashlib.sha256(raw).hexdigest()
                state.attempts_by_body[digest] += 1
                first_time = state.attempts_by_body[digest] == 1
            time.sleep(0.01)  # lets concurrent requests overlap
            self._answer(json.loads(raw), first_time)

        def _answer(self, body: dict, first_time: bool) -> None:
            if self.path != "/v1/chat/completions":
                return self._send(404, {"error": {"message": f"no route {self.path}"}})
            if self.headers.get("Authorization") != f"Bearer {API_KEY}":
                return self._send(401, {"error": {"message": "invalid api key", "type": "auth"}})
            question = body["messages"][1]["content"]
            if "ALWAYS_500" in question or ("SERVER_ERROR" in question and first_time):
                return self._send(500, {"error": {"message": "internal error"}})
            if "RATE_LIMITED" in question and first_time:
                return self._send(429, {"error": {"message": "slow down", "type": "rate_limit"}})
            self._send(200, chat_completion(body))

    return Handler


def chat_completion(body: dict) -> dict:
    """The OpenAI chat-completion object answering `body` with the scripted judge's answer."""
    return {
        "id": "chatcmpl-test",
        "object": "chat.completion",
        "created": 0,
        "model": body["model"],
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": scripted_answer(body["messages"])},
                "finish_reason": "stop",
            }
        ],
        "usage": {
            "prompt_tokens": PROMPT_TOKENS,
            "completion_tokens": COMPLETION_TOKENS,
            "total_tokens": PROMPT_TOKENS + COMPLETION_TOKENS,
        },
    }


@pytest.fixture()
def judge_server() -> Iterator[tuple[str, ServerState]]:
    state = ServerState()
    server = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(state))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1", state
    finally:
        server.shutdown()
        server.server_close()


def pair(number: int, question: str, reply_a: str, reply_b: str) -> EvalPair:
    prompt = ({"role": "user", "content": question},)
    return EvalPair(prompt_id=f"p{number}", prompt=prompt, reply_a=reply_a, reply_b=reply_b, category="test")


SCRIPTED_PAIRS = [
    pair(0, "How do I bake bread?", "GOOD: knead, rise, bake.", "Buy some."),
    pair(1, "How do I fix a tyre?", "No idea.", "GOOD: patch the tube."),
    pair(2, "Tell me a joke.", "A joke.", "Another joke."),
    pair(3, "POSITION_BIAS: best pet?", "GOOD: a cat.", "A rock."),
    pair(4, "RATE_LIMITED: capital of France?", "GOOD: Paris.", "Lyon."),
    pair(5, "SERVER_ERROR: 2 + 2?", "5.", "GOOD: 4."),
    pair(6, "MALFORMED_FIRST: colour of the sky?", "GOOD: blue.", "Green."),
    pair(7, "MALFORMED_ALWAYS: meaning of life?", "GOOD: 42.", "Unknown."),
    pair(8, "CONTRADICT: tea or coffee?", "GOOD: tea.", "Coffee."),
]
EXPECTED = [
    Verdict.A,
    Verdict.B,
    Verdict.TIE,
    Verdict.TIE,
    Verdict.A,
    Verdict.B,
    Verdict.A,
    Verdict.INVALID,
    Verdict.INVALID,
]
MAX_RETRIES = 2
# Two orders per pair; +1 per order for 429/500; +1 per order for one malformed answer; 3 per order when
# the answer never parses.
EXPECTED_REQUESTS = 2 * 4 + 4 + 4 + 4 + 6 + 6
FAILED_HTTP_REQUESTS = 4


def make_judge(base_url: str, cache_dir: Path, model: str = "judge-model", key: str = API_KEY) -> LlmJudge:
    endpoint = LlmEndpoint(base_url=base_url, model=model, api_key=key)
    return LlmJudge(endpoint, cache_dir, concurrency=SIMULTANEOUS_LIMIT, max_retries=MAX_RETRIES, backoff_base_s=0.01)


def test_scripted_verdicts_retries_and_accounting(judge_server, tmp_path: Path) -> None:
    base_url, state = judge_server
    judge = make_judge(base_url, tmp_path / "cache")
    judgements = judge.judge(SCRIPTED_PAIRS)

    assert [judgement.verdict for judgement in judgements] == EXPECTED
    position_bias = judgements[3].detail
    assert (position_bias["a_shown_first"], position_bias["b_shown_first"]) == ("A", "B")
    assert position_bias["position_swap_tie"] is True
    assert judgements[2].detail["position_swap_tie"] is False  # an agreed tie is not a swap tie
    assert len(judgements[7].detail["answers_a_shown_first"]) == 1 + MAX_RETRIES

    figures = judge.info().figures
    assert state.requests == EXPECTED_REQUESTS
    assert figures["requests_sent"] == EXPECTED_REQUESTS
    assert figures["http_retries"] == FAILED_HTTP_REQUESTS
    assert figures["malformed_retries"] == 2 + 2 * 2 * MAX_RETRIES
    assert figures["orders_invalid"] == 4
    assert figures["position_swap_ties"] == 1
    answered = EXPECTED_REQUESTS - FAILED_HTTP_REQUESTS
    assert figures["prompt_tokens"] == answered * PROMPT_TOKENS
    assert figures["completion_tokens"] == answered * COMPLETION_TOKENS
    assert figures["orders_from_cache"] == 0
    assert 1 <= state.max_in_flight <= SIMULTANEOUS_LIMIT


def test_a_rerun_sends_no_request(judge_server, tmp_path: Path) -> None:
    base_url, state = judge_server
    first = make_judge(base_url, tmp_path / "cache").judge(SCRIPTED_PAIRS)
    requests_after_first_run = state.requests

    rerun_judge = make_judge(base_url, tmp_path / "cache")
    rerun = rerun_judge.judge(SCRIPTED_PAIRS)
    assert state.requests == requests_after_first_run
    assert rerun == first  # invalid outcomes come back from the cache too
    figures = rerun_judge.info().figures
    assert figures["orders_from_cache"] == 2 * len(SCRIPTED_PAIRS)
    assert figures["requests_sent"] == 0 and figures["prompt_tokens"] == 0
    assert figures["cached_prompt_tokens"] == (EXPECTED_REQUESTS - FAILED_HTTP_REQUESTS) * PROMPT_TOKENS

    # The judge model is part of the key: another model is asked afresh.
    make_judge(base_url, tmp_path / "cache", model="another-judge").judge(SCRIPTED_PAIRS[:1])
    assert state.requests == requests_after_first_run + 2


def test_retries_run_out_and_judging_stops(judge_server, tmp_path: Path) -> None:
    base_url, state = judge_server
    failing = pair(9, "ALWAYS_500: anything?", "a", "b")
    with pytest.raises(LlmJudgeError, match="after 2 retries"):
        make_judge(base_url, tmp_path / "cache").judge([failing])
    assert set(state.attempts_by_body.values()) == {1 + MAX_RETRIES}  # each order: the try and 2 retries
    assert not list((tmp_path / "cache").rglob("*.json"))  # a transient failure is not an outcome


def test_a_wrong_key_fails_at_once_without_echoing_it(judge_server, tmp_path: Path) -> None:
    base_url, state = judge_server
    wrong_key = "sk-wrong-key-98765"
    with pytest.raises(LlmJudgeError, match="refused") as error:
        make_judge(base_url, tmp_path / "cache", key=wrong_key).judge(SCRIPTED_PAIRS[:1])
    assert wrong_key not in str(error.value)
    assert state.requests <= 2  # one per order at most: no retries on 401


class ErrorWithHeaders(Exception):
    def __init__(self, headers: dict[str, str]) -> None:
        super().__init__("error")
        self.response = SimpleNamespace(headers=headers)


def test_backoff_doubles_honours_retry_after_and_is_capped() -> None:
    assert [backoff_delay(attempt, ErrorWithHeaders({}), 0.5, 60.0) for attempt in range(4)] == [0.5, 1.0, 2.0, 4.0]
    assert backoff_delay(0, ErrorWithHeaders({"retry-after": "7"}), 0.5, 60.0) == 7.0
    assert backoff_delay(0, ErrorWithHeaders({"retry-after": "Wed, 21 Oct 2015 07:28:00 GMT"}), 0.5, 60.0) == 0.5
    assert backoff_delay(12, ErrorWithHeaders({}), 0.5, 60.0) == 60.0
    assert backoff_delay(1, ValueError("no response"), 0.5, 60.0) == 1.0


def test_parse_verdict() -> None:
    assert parse_verdict("blah\n[[1]]") is SlotVerdict.FIRST
    assert parse_verdict("**[[ 2 ]]**") is SlotVerdict.SECOND
    assert parse_verdict("[[TIE]]") is SlotVerdict.TIE
    assert parse_verdict("[[1]] and again [[1]]") is SlotVerdict.FIRST
    for malformed in ("[[1]] no, [[2]]", "Reply 1", "[1]", "", None):
        assert parse_verdict(malformed) is SlotVerdict.MALFORMED


def test_endpoint_from_environment() -> None:
    with pytest.raises(LlmEndpointError, match="RLHF_JUDGE_API_KEY.*OPENAI_API_KEY.*RLHF_JUDGE_BASE_URL"):
        LlmEndpoint.from_environment("gpt-4o", environ={})
    endpoint = LlmEndpoint.from_environment(
        "gpt-4o", environ={"OPENAI_API_KEY": API_KEY, "RLHF_JUDGE_BASE_URL": "http://host:1/v1/"}
    )
    assert (endpoint.base_url, endpoint.model, endpoint.api_key) == ("http://host:1/v1", "gpt-4o", API_KEY)
    assert API_KEY not in repr(endpoint)
    assert (
        LlmEndpoint.from_environment("gpt-4o", environ={"RLHF_JUDGE_API_KEY": "k", "RLHF_JUDGE_MODEL": "m"}).model
        == "m"
    )


# ---- the whole stage with the LLM judge: the key appears in no file and no log line


def write_tiny_inputs(root: Path) -> tuple[Path, Path, Path]:
    """Prepared data and two tiny causal-LM stage outputs."""
    from rlhf_core.models.saving import save_causal_lm
    from rlhf_core.models.tiny import build_tiny_model, load_tiny_model
    from rlhf_core.stages.prepare_data import run_prepare_data
    from rlhf_core.stages.result import write_metrics

    source = root / "pairs.jsonl"
    rows = [
        {
            "chosen": f"\n\nHuman: What is topic {i}?\n\nAssistant: GOOD: topic {i} is a topic.",
            "rejected": f"\n\nHuman: What is topic {i}?\n\nAssistant: No.",
        }
        for i in range(60)
    ]
    source.write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = load_config(PARAMS, overlays=[TINY])
    run_prepare_data(config, root / "data", source=str(source))
    tokenizer = load_tiny_model()[1]
    for name, seed in (("a", 0), ("b", 1)):
        save_causal_lm(build_tiny_model(tokenizer, seed=seed), tokenizer, root / name / "model")
        write_metrics(root / name, {"steps": 0.0})
    return root / "data", root / "a", root / "b"


def test_stage_with_llm_judge_never_writes_or_logs_the_key(
    judge_server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from rlhf_core.stages.evaluate import run_evaluate

    base_url, state = judge_server
    data_dir, model_a, model_b = write_tiny_inputs(tmp_path)
    config = load_config(
        PARAMS, overlays=[TINY], overrides=["evaluation.max_prompts=3", "evaluation.generation.max_new_tokens=6"]
    )
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    monkeypatch.setenv("RLHF_JUDGE_API_KEY", API_KEY)
    monkeypatch.setenv("RLHF_JUDGE_BASE_URL", base_url)
    monkeypatch.setenv("RLHF_JUDGE_MODEL", "judge-model")
    caplog.set_level(logging.DEBUG)
    out = tmp_path / "eval"

    result = run_evaluate(config, data_dir, model_a, model_b, out, judge="llm")

    keys = {
        json.loads(line)["pair_key"]
        for name in ("verdicts.jsonl", "verdicts_matched.jsonl", "verdicts_samples.jsonl", "verdicts_anchors.jsonl")
        for line in (out / name).read_text().splitlines()
    }
    # 3 prompts' main pairs, their second replies' pairs (tiny.yaml draws 2 per model), the length-matched
    # pairs and the anchor pairs (B's two replies), each distinct pair in both orders, no retries
    assert len(keys) >= 6 and state.requests == 2 * len(keys)
    report = json.loads((out / "report.json").read_text())
    assert report["judge"]["kind"] == "llm" and "judge-model" in report["judge"]["description"]
    assert report["judge"]["figures"]["prompt_tokens"] == 2 * len(keys) * PROMPT_TOKENS
    assert result.metrics["pairs"] == 3 and (out / "plots" / "win_rate.png").is_file()
    written = [path for path in out.rglob("*") if path.is_file()]
    assert any("judge_cache" in path.parts for path in written)
    for path in written:
        assert API_KEY.encode() not in path.read_bytes(), path
    assert any(record.name.startswith("openai") for record in caplog.records)  # the client's debug lines
    for record in caplog.records:
        assert API_KEY not in record.getMessage()
    assert API_KEY not in caplog.text

    # Rerunning the stage regenerates the same replies (same seed) and judges them from the cache.
    rerun = run_evaluate(config, data_dir, model_a, model_b, out, judge="llm")
    assert state.requests == 2 * len(keys)
    assert rerun.metrics["judge/orders_from_cache"] == 2 * len(keys)
    assert rerun.metrics["win_rate"] == result.metrics["win_rate"]
