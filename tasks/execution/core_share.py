"""The cores a training stage may use while another stage of the same pipeline run trains beside it.

The judge reward model needs only the prepared data, so the pipeline trains it beside SFT and the reward
model (flows/pipeline.py): two branches, the main line (SFT, then the reward model) and the stage beside
it. Two trainings that each take every core slow each other down by more than the overlap gains: their
thread pools fight over the cores (on a 2-core machine each would run 2 threads on 1 core's worth of
time). So while both branches train, the run's threads are split in two (`split_threads`): the stage beside
gets half, rounded down (at least 1), the main line the rest; a branch alone gets them all. The threads
split are what `torch.get_num_threads()` is when the run starts: the machine's cores, or fewer when
OMP_NUM_THREADS says so.

A stage's share is decided when it starts training; PyTorch's thread count belongs to the thread that sets
it, so only the training thread itself can change it later:
- A main-line stage in the flow's process follows its share at every optimizer step (`ThreadsFollowShare`,
  the logger its loop calls once a step): a reward model that starts while the judge still trains takes
  every thread at its first step after the judge ended. Measured before this (a default run): the reward
  model kept one of the two cores for the 32 minutes it trained after the judge ended, the other idle.
- The stage beside keeps its share to its end (its process's pool is sized at start-up); a judge that
  starts after the main line ended (SFT and the reward model cached) has every thread.
- The stage beside always trains in its own process (`tasks/stages/stage_tasks.py` `run_launched`), started with
  OMP_NUM_THREADS set to its share (PyTorch's intra-op pool reads it at start-up). Two trainings in one
  process could not be given separate thread counts (PyTorch's count and its kernels' are process-wide) and
  would share Python's interpreter lock.
- The main line's stages train in the flow's process as before, with `torch.set_num_threads` at their share
  (`stage_threads`, restored after), or, launched on several processes, with OMP_NUM_THREADS at their share
  divided by the number of processes.

`CORE_SHARE` holds the share of the branch run in the current context; the thread of the stage beside
(flows/stage_branch.py) sets its own. `stop` is set when the other branch failed, and stops the branch's
launch (rlhf_core/distributed/launcher.py).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch

from rlhf_core.training.logger import MetricsLogger

THREADS_ENV = "OMP_NUM_THREADS"
MAIN_LINE = "main line"
BESIDE = "beside"


def split_threads(total: int) -> tuple[int, int]:
    """(main line, beside): the stage beside gets half of `total` rounded down, the main line the rest;
    each at least 1."""
    beside = max(1, total // 2)
    return max(1, total - beside), beside


class CoreSplit:
    """The run's threads, and which branches are training now (`join`, `leave`)."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.training: set[str] = set()
        self.lock = threading.Lock()

    def join(self, branch: str) -> None:
        with self.lock:
            self.training.add(branch)

    def leave(self, branch: str) -> None:
        with self.lock:
            self.training.discard(branch)

    def threads(self, branch: str) -> int:
        """`branch`'s threads now: all of them while the other branch is not training, else its half."""
        with self.lock:
            if not self.training - {branch}:
                return self.total
        main, beside = split_threads(self.total)
        return main if branch == MAIN_LINE else beside


@dataclass(frozen=True)
class CoreShare:
    """One branch's share of a `CoreSplit`, and the event that stops the branch's launches."""

    split: CoreSplit
    branch: str
    stop: threading.Event = field(default_factory=threading.Event)

    @property
    def threads(self) -> int:
        return self.split.threads(self.branch)

    def launch_env(self, processes: int) -> dict[str, str]:
        """The environment that holds each of `processes` launched processes to its part of the share now."""
        return {THREADS_ENV: str(max(1, self.threads // processes))}


CORE_SHARE: ContextVar[CoreShare | None] = ContextVar("rlhf_core_share", default=None)


def core_shares() -> tuple[CoreShare, CoreShare]:
    """(main line, beside): the shares of this process's PyTorch threads, both branches training."""
    split = CoreSplit(torch.get_num_threads())
    split.join(MAIN_LINE)
    split.join(BESIDE)
    return CoreShare(split, MAIN_LINE), CoreShare(split, BESIDE)


@contextmanager
def stage_threads() -> Iterator[None]:
    """A main-line stage trained in this process uses its branch's share as it starts (restored after);
    without a `CORE_SHARE` (no stage beside) nothing changes."""
    share = CORE_SHARE.get()
    if share is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(share.threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class ThreadsFollowShare:
    """A main-line stage's logger that, at each step the loop logs, first sets the calling (training)
    thread's PyTorch threads to the branch's share now, then passes everything on to `inner`."""

    def __init__(self, inner: MetricsLogger, share: CoreShare) -> None:
        self.inner = inner
        self.share = share

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        threads = self.share.threads
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        self.inner.log_metrics(metrics, step)

    def log_params(self, params: dict[str, object]) -> None:
        self.inner.log_params(params)

    def close(self) -> None:
        self.inner.close()


def following_share(logger: MetricsLogger) -> MetricsLogger:
    """`logger` for a stage trained in this process: on the main line beside another stage, wrapped so
    that the stage follows its share (`ThreadsFollowShare`); otherwise as it is."""
    share = CORE_SHARE.get()
    if share is None or share.branch != MAIN_LINE:
        return logger
    return ThreadsFollowShare(logger, share)


@contextmanager
def branch(share: CoreShare) -> Iterator[None]:
    """The block is `share`'s branch: its stages see `share` (`CORE_SHARE`), and when the block ends the
    branch leaves the split, so that a stage the other branch starts after it gets every thread."""
    token = CORE_SHARE.set(share)
    try:
        yield
    finally:
        share.split.leave(share.branch)
        CORE_SHARE.reset(token)
