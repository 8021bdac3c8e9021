"""Error records: how a failing rank tells the launching process what went wrong, and when.

When one rank raises, the `deepspeed` launcher kills the others, and they often die with errors of
their own (a collective whose peer vanished). To name the rank that failed FIRST, each rank started
through `launcher.py` writes a JSON record of its exception, with a timestamp, into the directory named
by `RLHF_RANK_ERROR_DIR` before exiting; the launching process reads them back after a failure.
"""

from __future__ import annotations

import json
import os
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from rlhf_core.atomic import atomic_write_text
from rlhf_core.distributed.context import rank_context

ERROR_DIR_ENV = "RLHF_RANK_ERROR_DIR"


@dataclass(frozen=True)
class RankError:
    """One rank's exception: its type and message, the formatted traceback, and when it was raised."""

    rank: int
    error_type: str
    message: str
    traceback: str
    time: float


def _record_path(directory: Path, rank: int) -> Path:
    return directory / f"rank-{rank}.json"


@contextmanager
def recording_rank_errors() -> Iterator[None]:
    """Write an error record for any exception raised in the block, then let it propagate.

    Does nothing when `RLHF_RANK_ERROR_DIR` is unset (a rank not started by `launcher.py`).
    """
    try:
        yield
    except BaseException as error:
        directory = os.environ.get(ERROR_DIR_ENV)
        if directory:
            rank = rank_context().rank
            record = {
                "rank": rank,
                "error_type": type(error).__name__,
                "message": str(error),
                "traceback": traceback.format_exc(),
                "time": time.time(),
            }
            atomic_write_text(_record_path(Path(directory), rank), json.dumps(record, indent=2))
        raise


def read_rank_errors(directory: Path) -> list[RankError]:
    """The error records in `directory`, earliest first (the first is the rank that failed first)."""
    records = [json.loads(path.read_text(encoding="utf-8")) for path in Path(directory).glob("rank-*.json")]
    return sorted((RankError(**record) for record in records), key=lambda error: error.time)
