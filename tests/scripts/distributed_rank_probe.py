"""What each rank runs in tests/distributed/test_distributed_launcher.py: print a line, then fail.

`--fail-rank R --message M`: every rank prints its hello lines; rank R waits until every rank has (so
that each rank has output for the launcher to show) and raises ValueError(M) (recorded for the
launcher); every other rank waits until rank R's error record exists and then raises a secondary error
of its own, unless the launcher kills it first (a rank that waits for a rank beyond the world waits a
minute: a long launch to stop).
With `--abort`, rank R prints M and aborts the process instead (a native crash: no error record).
"""

import argparse
import os
import time
from pathlib import Path

from rlhf_core.distributed.context import rank_context
from rlhf_core.distributed.rank_errors import ERROR_DIR_ENV, recording_rank_errors


def wait_for(path: Path) -> None:
    """Until `path` exists, or a minute has passed."""
    deadline = time.monotonic() + 60
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fail-rank", type=int, required=True)
    parser.add_argument("--message", required=True)
    parser.add_argument("--abort", action="store_true")
    args = parser.parse_args()
    context = rank_context()
    print(f"hello from rank {context.rank} of {context.world_size}", flush=True)
    print(f"pid {os.getpid()}", flush=True)
    shared = Path(os.environ[ERROR_DIR_ENV])
    (shared / f"hello-{context.rank}").touch()
    if context.rank == args.fail_rank:
        for rank in range(context.world_size):
            wait_for(shared / f"hello-{rank}")
    with recording_rank_errors():
        if context.rank == args.fail_rank and args.abort:
            print(args.message, flush=True)
            os.abort()
        if context.rank == args.fail_rank:
            raise ValueError(args.message)
        wait_for(shared / f"rank-{args.fail_rank}.json")
        raise RuntimeError(f"rank {context.rank}: my peer went away")


if __name__ == "__main__":
    main()
