"""The LLM judge's on-disk cache: every outcome it ever got, so a rerun sends no request for it.

One judging request is identified by (prompt, first reply, second reply, judge model, judging-prompt
version): the key is the sha256 of those, so both presentation orders of a pair are two entries, and
changing the model or the prompt wording never reuses an old verdict. Malformed outcomes (the judge
never answered in the required form) are cached too: asking again would cost the same and most likely
fail the same way. Transient API failures are NOT outcomes and are never cached.

Each entry is one small JSON file, `<cache dir>/<key[:2]>/<key>.json`, written to a temporary file and
moved into place, so concurrent workers never see half an entry and a crash leaves none. The API key
is never part of an entry.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from rlhf_core.data.records import Message
from rlhf_core.evaluation.judges.llm_prompt import SlotVerdict


def cache_key(prompt: Sequence[Message], first: str, second: str, model: str, prompt_version: str) -> str:
    """sha256 hex of the request's identity (see the module docstring)."""
    identity = [[dict(message) for message in prompt], first, second, model, prompt_version]
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class JudgeOutcome:
    """What judging one presentation order came to, and what it cost.

    `verdict` is MALFORMED when no answer of `requests` attempts was in the required form; `answers`
    are the judge's raw answers, in order.
    """

    verdict: SlotVerdict
    answers: tuple[str, ...]
    requests: int
    prompt_tokens: int
    completion_tokens: int


class JudgeCache:
    """A directory of `JudgeOutcome`s by cache key."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)

    def _path(self, key: str) -> Path:
        return self.directory / key[:2] / f"{key}.json"

    def get(self, key: str) -> JudgeOutcome | None:
        """The cached outcome of `key`, or None."""
        path = self._path(key)
        if not path.is_file():
            return None
        try:
            fields = json.loads(path.read_text(encoding="utf-8"))
            return JudgeOutcome(
                verdict=SlotVerdict(fields["verdict"]),
                answers=tuple(fields["answers"]),
                requests=int(fields["requests"]),
                prompt_tokens=int(fields["prompt_tokens"]),
                completion_tokens=int(fields["completion_tokens"]),
            )
        except (ValueError, KeyError, TypeError) as err:
            raise ValueError(f"judge cache entry {path} is unreadable ({err}); delete it to judge again") from err

    def put(self, key: str, outcome: JudgeOutcome) -> None:
        """Store `outcome` under `key` atomically (a concurrent `put` of the same key is harmless)."""
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        fields = {**asdict(outcome), "verdict": outcome.verdict.value, "answers": list(outcome.answers)}
        handle, temp_name = tempfile.mkstemp(prefix=f".{key}.", dir=path.parent)
        try:
            with os.fdopen(handle, "w", encoding="utf-8") as temp:
                json.dump(fields, temp, indent=1)
            os.replace(temp_name, path)
        except BaseException:
            Path(temp_name).unlink(missing_ok=True)
            raise
