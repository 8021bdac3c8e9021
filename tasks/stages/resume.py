"""Resuming a training stage that an earlier pipeline run left unfinished.

Prefect's retries resume a crashed stage inside one flow run: the retry writes to the same run
directory, where the stage finds its newest checkpoint. A process that is killed outright (SIGKILL,
a lost machine, Ctrl-C twice) ends the flow run instead, and the next `rlhf run` is a new flow run
with a new run directory. Without help it would train that stage from scratch.

So a training stage claims its output directory under its cache key (tasks/execution/caching.py: the same
inputs and settings give the same key) before it trains: `<cache_dir>/in_progress/<key>.json` names
the directory. The next attempt with the same key, in any run, finds the claim; while the claimed
directory exists and is incomplete (no metrics.json, the marker every stage writes last) the
attempt trains in that directory and resumes from its newest checkpoint. A finished stage releases
its claim; from then on the cache record answers for it.

Claims are only read and written while the stage holds this machine's training slot
(tasks/execution/concurrency.py), so two live runs never resume into the same directory.
"""

from __future__ import annotations

import json
from pathlib import Path

from prefect.logging import get_logger

from rlhf_core.atomic import atomic_write_text
from rlhf_core.stage_outputs import COMPLETE_MARKER

CLAIMS_SUBDIR = "in_progress"

logger = get_logger(__name__)


def claim_out_dir(cache_dir: Path, key: str, fresh_dir: Path) -> Path:
    """The directory this attempt of a stage writes to: an interrupted earlier attempt's, or `fresh_dir`."""
    claim = claim_path(cache_dir, key)
    if claim.is_file():
        earlier = Path(json.loads(claim.read_text())["out_dir"])
        if earlier.is_dir() and not (earlier / COMPLETE_MARKER).exists():
            if earlier != fresh_dir:
                logger.info("resuming the unfinished output of an earlier run in %s", earlier)
            return earlier
    claim.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(claim, json.dumps({"out_dir": str(fresh_dir)}))
    return fresh_dir


def release_claim(cache_dir: Path, key: str) -> None:
    """Forget the claim of a finished stage (its cache record now answers for it)."""
    claim_path(cache_dir, key).unlink(missing_ok=True)


def claim_path(cache_dir: Path, key: str) -> Path:
    return cache_dir / CLAIMS_SUBDIR / f"{key}.json"
