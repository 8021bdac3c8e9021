"""The machine's training slot without a Prefect server, or with one that keeps its leases in memory: an
exclusive file lock (tasks/execution/concurrency.py, the lock of rlhf_core/file_lock.py).

With Prefect's temporary server the slot cannot be a global concurrency limit: that server does not
reap the leases of killed holders, so one killed run kept every later run waiting forever. These tests
check the lock itself; the kill-and-rerun tests (test_orchestration_kill_resume.py,
test_ablation_kill_resume.py) check that a killed run's slot does not stop the rerun.
"""

from __future__ import annotations

import contextvars
import fcntl
import json
import logging
import os
import threading
from pathlib import Path

import pytest
from prefect.settings import PREFECT_API_URL, PREFECT_HOME, temporary_settings

from fixtures.servers import prefect_settings_server
from tasks.execution import concurrency
from tasks.execution.concurrency import shared_training_slot, training_lock, training_slot
from tasks.services.service_outages import MEMORY_LEASE_STORAGE

WAIT_POLLS = 400  # of 50 ms: how long a test waits for the other thread before it fails instead of hanging


def is_locked(path: Path) -> bool:
    """Whether another open file description holds an exclusive flock on `path`."""
    with path.open("a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(handle, fcntl.LOCK_UN)
        return False


def test_the_lock_is_held_inside_the_block_names_its_holder_and_is_free_after(tmp_path: Path) -> None:
    path = tmp_path / "locks" / "rlhf-training-host.lock"
    with training_lock(path, "sft"):
        assert is_locked(path)
        record = json.loads(path.read_text())
        assert (record["pid"], record["host"], record["stage"]) == (os.getpid(), os.uname().nodename, "sft")
    assert not is_locked(path)


def test_the_lock_is_released_when_the_block_raises(tmp_path: Path) -> None:
    path = tmp_path / "rlhf-training-host.lock"
    with pytest.raises(RuntimeError), training_lock(path, "sft"):
        raise RuntimeError("training failed")
    assert not is_locked(path)


def test_a_second_holder_waits_for_the_first_and_says_whom_it_waits_for(tmp_path: Path) -> None:
    path = tmp_path / "rlhf-training-host.lock"
    messages: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())  # type: ignore[method-assign]
    level = concurrency.logger.level
    concurrency.logger.addHandler(handler)
    concurrency.logger.setLevel(logging.INFO)
    order: list[str] = []
    try:
        with training_lock(path, "sft"):
            second = threading.Thread(target=lambda: _hold(path, order), daemon=True)
            second.start()
            for _ in range(WAIT_POLLS):  # until the second holder finds the lock taken and logs why it waits
                if messages or not second.is_alive():
                    break
                second.join(timeout=0.05)
            order.append("first released")
        second.join(timeout=WAIT_POLLS * 0.05)
    finally:
        concurrency.logger.removeHandler(handler)
        concurrency.logger.setLevel(level)
    assert order == ["first released", "second acquired"]
    assert len(messages) == 1
    holder = f"pid {os.getpid()} on host {os.uname().nodename}"
    waiting = f"waiting for this machine's training slot, held by {holder} (stage sft, started 20"
    assert messages[0].startswith(waiting) and messages[0].endswith(f") ({path})")


def _hold(path: Path, order: list[str]) -> None:
    with training_lock(path, "reward"):
        order.append("second acquired")


def test_without_a_prefect_server_the_slot_is_the_lock_under_prefect_home(tmp_path: Path) -> None:
    with temporary_settings(updates={PREFECT_API_URL: None, PREFECT_HOME: str(tmp_path)}):
        with training_slot("sft", "rlhf-training-test-host"):
            assert is_locked(tmp_path / "rlhf-training-test-host.lock")
    assert not is_locked(tmp_path / "rlhf-training-test-host.lock")


def test_stages_of_one_run_that_train_at_once_share_one_slot_until_the_run_gives_it_back(tmp_path: Path) -> None:
    """Inside `shared_training_slot` the first stage to train takes the lock, a stage training beside it (in
    another thread, with a copy of the context) joins it instead of waiting, and the lock is held until the
    block ends, not only while a stage trains."""
    name = "rlhf-training-shared-host"
    lock = tmp_path / f"{name}.lock"
    inside: list[str] = []
    with temporary_settings(updates={PREFECT_API_URL: None, PREFECT_HOME: str(tmp_path)}):
        with shared_training_slot(name):
            assert not is_locked(lock)  # nothing trains yet: nothing taken (a cached stage takes nothing)
            with training_slot(name):
                inside.append("main line")
                beside = threading.Thread(target=contextvars.copy_context().run, args=(_train, name, inside))
                beside.start()
                beside.join(timeout=WAIT_POLLS * 0.05)
            assert inside == ["main line", "beside"]  # it joined the slot the main line holds
            assert is_locked(lock)  # still the run's until the block ends
        assert not is_locked(lock)


def _train(name: str, inside: list[str]) -> None:
    with training_slot(name):
        inside.append("beside")


def test_with_a_server_that_keeps_leases_in_memory_the_slot_is_the_lock_too(tmp_path: Path) -> None:
    # The stand-in server answers only its settings: taking its global concurrency limit instead would fail.
    with prefect_settings_server(MEMORY_LEASE_STORAGE) as api_url:
        with temporary_settings(updates={PREFECT_API_URL: api_url, PREFECT_HOME: str(tmp_path)}):
            with training_slot("sft", "rlhf-training-test-host"):
                assert is_locked(tmp_path / "rlhf-training-test-host.lock")
    assert not is_locked(tmp_path / "rlhf-training-test-host.lock")
