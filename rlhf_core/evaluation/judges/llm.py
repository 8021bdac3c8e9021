"""The LLM judge (the paper's GPT-4 evaluation, section 6) over any OpenAI-compatible chat API.

Each pair is judged twice, once with model A's reply shown first and once with it shown second. LLM
judges prefer a position; a verdict that flips with the order is a tie, and only a verdict that
survives the swap counts as a win or a loss. If either order ends without a parseable verdict the pair
is invalid (reported, never guessed from the other order alone).

Per order (one "judging request"):
- The answer must contain a verdict marker (llm_prompt.py). A malformed answer is followed up, in the
  same conversation, by a request for the verdict alone, at most `max_retries` times; after that the
  order is MALFORMED.
- Every HTTP call is retried on 408, 409, 429, 5xx and connection errors, at most `max_retries` times,
  waiting `backoff_base_s * 2**attempt` seconds (or the server's Retry-After, whichever is longer),
  capped at `max_backoff_s`. The openai client's own retries are switched off (`max_retries=0`) so this
  is the only retry policy, and its counts are reported. Other errors (401, 404, 400: a wrong key,
  model or URL) fail at once. When retries run out, judging stops with `LlmJudgeError`; outcomes
  reached so far are cached, so a rerun resumes where it stopped.
- Outcomes (malformed ones included) are cached on disk (llm_cache.py) before they are used: a rerun
  sends no request for anything judged before.

Requests run in a thread pool of `concurrency` workers (the openai client is thread-safe); results are
gathered in the calling thread, so no counter is shared between threads. The API key goes to the
client and nowhere else; error messages are scrubbed of it.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import openai

from rlhf_core.data.records import Message
from rlhf_core.evaluation.judges.llm_cache import JudgeCache, JudgeOutcome, cache_key
from rlhf_core.evaluation.judges.llm_endpoint import LlmEndpoint
from rlhf_core.evaluation.judges.llm_prompt import (
    JUDGE_PROMPT_VERSION,
    SlotVerdict,
    judge_messages,
    parse_verdict,
    reask_messages,
)
from rlhf_core.evaluation.judges.verdicts import EvalPair, JudgeInfo, Judgement, Verdict
from rlhf_core.progress import progress

LOGGER = logging.getLogger(__name__)

MAX_ANSWER_TOKENS = 400
RETRYABLE_STATUS = frozenset({408, 409, 429})


class LlmJudgeError(RuntimeError):
    """The judge API failed in a way retrying cannot fix (or retries ran out)."""


@dataclass(frozen=True)
class Completion:
    """One successful chat completion: the answer text, its token usage, and the HTTP retries it took."""

    text: str
    prompt_tokens: int
    completion_tokens: int
    http_retries: int


@dataclass(frozen=True)
class OrderResult:
    """The outcome of judging one presentation order, whether it came from the cache, and HTTP retries."""

    outcome: JudgeOutcome
    from_cache: bool
    http_retries: int


def is_retryable(error: Exception) -> bool:
    """Rate limits, server errors, timeouts and dropped connections are worth retrying; nothing else."""
    if isinstance(error, openai.APIConnectionError):  # includes APITimeoutError
        return True
    if isinstance(error, openai.APIStatusError):
        return error.status_code in RETRYABLE_STATUS or error.status_code >= 500
    return False


def retry_after_seconds(error: Exception) -> float | None:
    """The server's Retry-After header in seconds, when it sent a numeric one."""
    response = getattr(error, "response", None)
    if response is None:
        return None
    try:
        return float(response.headers.get("retry-after", ""))
    except ValueError:
        return None


def backoff_delay(attempt: int, error: Exception, base_s: float, max_s: float) -> float:
    """Seconds to wait before retry `attempt + 1`: base * 2**attempt, or the server's Retry-After if longer,
    capped at `max_s`."""
    return min(max_s, max(base_s * 2**attempt, retry_after_seconds(error) or 0.0))


def slot_to_verdict(slot: SlotVerdict, a_shown_first: bool) -> Verdict:
    """Translate "first/second reply" back to model A/B for the order the judge saw."""
    if slot is SlotVerdict.MALFORMED:
        return Verdict.INVALID
    if slot is SlotVerdict.TIE:
        return Verdict.TIE
    first_won = slot is SlotVerdict.FIRST
    return Verdict.A if first_won == a_shown_first else Verdict.B


def combine_orders(a_first: Verdict, b_first: Verdict) -> Verdict:
    """The pair's verdict from both orders: invalid if either is, the common verdict, else a tie."""
    if Verdict.INVALID in (a_first, b_first):
        return Verdict.INVALID
    return a_first if a_first == b_first else Verdict.TIE


class LlmJudge:
    """Pairwise judge over an OpenAI-compatible chat-completions API; see the module docstring."""

    def __init__(
        self,
        endpoint: LlmEndpoint,
        cache_dir: str | Path,
        concurrency: int,
        max_retries: int,
        backoff_base_s: float = 1.0,
        max_backoff_s: float = 60.0,
        timeout_s: float = 120.0,
    ) -> None:
        if concurrency < 1 or max_retries < 0:
            raise ValueError(f"need concurrency >= 1 and max_retries >= 0, got {concurrency}, {max_retries}")
        self.endpoint = endpoint
        self.cache = JudgeCache(cache_dir)
        self.concurrency = concurrency
        self.max_retries = max_retries
        self.backoff_base_s = backoff_base_s
        self.max_backoff_s = max_backoff_s
        self.client = openai.OpenAI(
            base_url=endpoint.base_url, api_key=endpoint.api_key, max_retries=0, timeout=timeout_s
        )
        self.figures: dict[str, float] = dict.fromkeys(
            (
                "pairs_judged",
                "requests_sent",
                "http_retries",
                "malformed_retries",
                "orders_from_cache",
                "orders_invalid",
                "position_swap_ties",
                "prompt_tokens",
                "completion_tokens",
                "cached_prompt_tokens",
                "cached_completion_tokens",
            ),
            0.0,
        )

    # ---- one HTTP call, with retries

    def _scrubbed(self, error: Exception) -> str:
        return str(error).replace(self.endpoint.api_key, "***")

    def _complete(self, messages: list[dict[str, str]]) -> Completion:
        """One chat completion, retrying transient failures with exponential backoff."""
        for attempt in range(self.max_retries + 1):
            try:
                response = self.client.chat.completions.create(
                    model=self.endpoint.model, messages=messages, temperature=0.0, max_tokens=MAX_ANSWER_TOKENS
                )
            except openai.OpenAIError as error:
                if not is_retryable(error):
                    raise LlmJudgeError(
                        f"the judge API refused the request (not retried): {self._scrubbed(error)}"
                    ) from None
                if attempt == self.max_retries:
                    raise LlmJudgeError(
                        f"the judge API still failed after {self.max_retries} retries: {self._scrubbed(error)}; "
                        "outcomes so far are cached, rerun to continue"
                    ) from None
                delay = backoff_delay(attempt, error, self.backoff_base_s, self.max_backoff_s)
                LOGGER.warning(
                    "LLM judge: %s; retry %d of %d in %.2f s",
                    type(error).__name__,
                    attempt + 1,
                    self.max_retries,
                    delay,
                )
                time.sleep(delay)
                continue
            usage = response.usage
            text = (response.choices[0].message.content or "") if response.choices else ""
            return Completion(
                text=text,
                prompt_tokens=usage.prompt_tokens if usage else 0,
                completion_tokens=usage.completion_tokens if usage else 0,
                http_retries=attempt,
            )
        raise AssertionError("unreachable: the loop returns or raises")

    # ---- one presentation order, with re-asks for malformed answers

    def _judge_order(self, prompt: Sequence[Message], first: str, second: str) -> OrderResult:
        """The (cached) outcome of asking which of `first` and `second` is better."""
        key = cache_key(prompt, first, second, self.endpoint.model, JUDGE_PROMPT_VERSION)
        cached = self.cache.get(key)
        if cached is not None:
            return OrderResult(outcome=cached, from_cache=True, http_retries=0)
        messages = judge_messages(prompt, first, second)
        answers: list[str] = []
        prompt_tokens = completion_tokens = http_retries = 0
        verdict = SlotVerdict.MALFORMED
        for attempt in range(self.max_retries + 1):
            if attempt:
                messages = reask_messages(messages, answers[-1])
            completion = self._complete(messages)
            answers.append(completion.text)
            prompt_tokens += completion.prompt_tokens
            completion_tokens += completion.completion_tokens
            http_retries += completion.http_retries
            verdict = parse_verdict(completion.text)
            if verdict is not SlotVerdict.MALFORMED:
                break
            LOGGER.info("LLM judge: answer without a verdict (attempt %d of %d)", attempt + 1, self.max_retries + 1)
        outcome = JudgeOutcome(
            verdict=verdict,
            answers=tuple(answers),
            requests=len(answers),
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
        )
        self.cache.put(key, outcome)
        return OrderResult(outcome=outcome, from_cache=False, http_retries=http_retries)

    def _judge_all_orders(self, pairs: Sequence[EvalPair]) -> list[tuple[OrderResult, OrderResult]]:
        """Both orders of every pair through the thread pool; the first failure cancels what has not started.
        A progress bar counts the verdicts in (rlhf_core/progress.py)."""
        with (
            concurrent.futures.ThreadPoolExecutor(max_workers=self.concurrency) as pool,
            progress(2 * len(pairs), "llm judge", "verdict") as answered,
        ):
            futures = [
                (
                    pool.submit(self._judge_order, pair.prompt, pair.reply_a, pair.reply_b),
                    pool.submit(self._judge_order, pair.prompt, pair.reply_b, pair.reply_a),
                )
                for pair in pairs
            ]
            flat = [future for both in futures for future in both]
            for future in flat:
                future.add_done_callback(lambda _: answered.advance())
            done, _ = concurrent.futures.wait(flat, return_when=concurrent.futures.FIRST_EXCEPTION)
            errors = [future.exception() for future in flat if future in done and future.exception()]
            if errors:
                pool.shutdown(wait=True, cancel_futures=True)
                raise errors[0]
            return [(a_first.result(), b_first.result()) for a_first, b_first in futures]

    def _count(self, result: OrderResult) -> None:
        outcome = result.outcome
        figures = self.figures
        if result.from_cache:
            figures["orders_from_cache"] += 1
            figures["cached_prompt_tokens"] += outcome.prompt_tokens
            figures["cached_completion_tokens"] += outcome.completion_tokens
        else:
            figures["requests_sent"] += outcome.requests + result.http_retries
            figures["http_retries"] += result.http_retries
            figures["malformed_retries"] += outcome.requests - 1
            figures["prompt_tokens"] += outcome.prompt_tokens
            figures["completion_tokens"] += outcome.completion_tokens
        figures["orders_invalid"] += outcome.verdict is SlotVerdict.MALFORMED

    def judge(self, pairs: Sequence[EvalPair]) -> list[Judgement]:
        """One verdict per pair, from both presentation orders (module docstring)."""
        judgements = []
        for a_first, b_first in self._judge_all_orders(pairs):
            self._count(a_first)
            self._count(b_first)
            verdict_a_first = slot_to_verdict(a_first.outcome.verdict, a_shown_first=True)
            verdict_b_first = slot_to_verdict(b_first.outcome.verdict, a_shown_first=False)
            verdict = combine_orders(verdict_a_first, verdict_b_first)
            swap_tie = verdict is Verdict.TIE and verdict_a_first != verdict_b_first
            self.figures["position_swap_ties"] += swap_tie
            judgements.append(
                Judgement(
                    verdict=verdict,
                    detail={
                        "a_shown_first": verdict_a_first.value,
                        "b_shown_first": verdict_b_first.value,
                        "position_swap_tie": swap_tie,
                        "answers_a_shown_first": list(a_first.outcome.answers),
                        "answers_b_shown_first": list(b_first.outcome.answers),
                    },
                )
            )
        self.figures["pairs_judged"] += len(pairs)
        return judgements

    def info(self) -> JudgeInfo:
        """Model, endpoint, prompt version, and the request and token counts of this judge so far."""
        return JudgeInfo(
            kind="llm",
            name=f"LLM {self.endpoint.model}",
            role=f"the LLM judge {self.endpoint.model}",
            description=(
                f"LLM judge {self.endpoint.model} at {self.endpoint.base_url} (judging prompt "
                f"{JUDGE_PROMPT_VERSION}; each pair judged in both orders, an order-dependent verdict is a tie)"
            ),
            in_sample=False,
            figures=dict(self.figures),
        )
