"""A main-line stage's threads follow its share of the cores at each step (tasks/execution/core_share.py): the stage
beside ending hands its cores to the stage training on the main line, at that stage's next step."""

from __future__ import annotations

import threading

import torch

from tasks.execution.core_share import BESIDE, CORE_SHARE, MAIN_LINE, CoreShare, CoreSplit, following_share


class StepThreads:
    """A stage's logger: the training thread's PyTorch threads at each logged step."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, int]] = []

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.seen.append((step, torch.get_num_threads()))

    def log_params(self, params: dict[str, object]) -> None:
        pass

    def close(self) -> None:
        pass


def in_a_training_thread(
    share: CoreShare | None, steps: list[int], after_step_1: threading.Event
) -> tuple[StepThreads, threading.Thread]:
    """A stand-in main-line stage in a thread of its own, as a flow's task trains: its threads set to the share
    as it starts (as `stage_threads` does), then `steps` logged, waiting after step 1 for `after_step_1`."""
    recorder = StepThreads()

    def train() -> None:
        CORE_SHARE.set(share)
        if share is not None:
            torch.set_num_threads(share.threads)
        logger = following_share(recorder)
        for step in steps:
            logger.log_metrics({"loss": 1.0}, step)
            if step == 1:
                after_step_1.wait(timeout=30)

    thread = threading.Thread(target=train)
    thread.start()
    return recorder, thread


def test_a_main_line_stage_takes_every_thread_at_its_first_step_after_the_stage_beside_ended() -> None:
    split = CoreSplit(4)
    split.join(MAIN_LINE)
    split.join(BESIDE)
    beside_ended = threading.Event()
    recorder, thread = in_a_training_thread(CoreShare(split, MAIN_LINE), [1, 2, 3], beside_ended)
    split.leave(BESIDE)
    beside_ended.set()
    thread.join(timeout=30)

    assert recorder.seen == [(1, 2), (2, 4), (3, 4)]


def test_without_a_stage_beside_the_logger_is_left_as_it_is() -> None:
    recorder = StepThreads()
    assert following_share(recorder) is recorder
    split = CoreSplit(4)
    split.join(BESIDE)
    token = CORE_SHARE.set(CoreShare(split, BESIDE))  # the stage beside trains in a process of its own
    try:
        assert following_share(recorder) is recorder
    finally:
        CORE_SHARE.reset(token)
