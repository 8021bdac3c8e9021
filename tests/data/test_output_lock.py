"""One writer per output directory (rlhf_core/output_lock.py): a second writer fails at once naming the
holder, a lock left by a killed process is taken over, and two real `rlhf sft` (or `rlhf eval`)
processes on one `--out` cannot mix their outputs; a SIGKILL of the lock-holding stage is followed by a
successful rerun. Every stage that writes an output directory takes the lock, eval and score-pairs too."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from fixtures.commands import RLHF_COMMAND
from fixtures.paths import ROOT, TINY
from fixtures.tiny_ppo import save_rm_output, save_sft_output, tiny_config  # noqa: F401
from rlhf_core.models.tiny import load_tiny_model
from rlhf_core.output_lock import OutputLockedError, lock_path, output_lock
from rlhf_core.stages.evaluate import run_evaluate
from rlhf_core.stages.prepare_data import run_prepare_data
from rlhf_core.stages.score_pairs import score_pair_file
from rlhf_core.stages.sft import run_sft
from rlhf_core.training.checkpoint import complete_checkpoints

pytestmark = pytest.mark.usefixtures("one_thread")

HOLD_LOCK = """
import sys, time
from pathlib import Path
from rlhf_core.output_lock import output_lock

with output_lock(Path(sys.argv[1]), "holder"):
    print("locked", flush=True)
    time.sleep(600)
"""
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


@pytest.fixture
def holder(tmp_path: Path) -> Iterator[subprocess.Popen[str]]:
    """Another process holding the lock of `tmp_path / "out"`."""
    process = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(tmp_path / "out")], stdout=subprocess.PIPE, text=True, cwd=ROOT
    )
    assert process.stdout is not None and process.stdout.readline().strip() == "locked"
    yield process
    if process.poll() is None:
        process.kill()
    process.wait(timeout=30)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A finished SFT output and a finished reward-model output (tiny, untrained), to evaluate with."""
    root = tmp_path_factory.mktemp("lock-models")
    tokenizer = load_tiny_model()[1]
    return save_sft_output(root / "sft", tokenizer, seed=0), save_rm_output(root / "reward", tokenizer, seed=1)


def wait_for(condition: Callable[[], object], what: str, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def lock_pid(out: Path) -> int | None:
    try:
        return json.loads(lock_path(out).read_text())["pid"]
    except (FileNotFoundError, ValueError, KeyError):
        return None


def rlhf_sft(data_dir: Path, out: Path, *overrides: str) -> subprocess.Popen[str]:
    settings = [item for override in overrides for item in ("-s", override)]
    return rlhf("sft", "-c", TINY, *settings, "--data-dir", data_dir, "--out", out)


def rlhf(*args: str | Path) -> subprocess.Popen[str]:
    """`rlhf ARGS...` started in its own process."""
    return subprocess.Popen(
        [*RLHF_COMMAND, *map(str, args)], cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


# --- the lock ---------------------------------------------------------------------------------------------


def test_a_second_writer_fails_at_once_naming_the_holder(holder: subprocess.Popen[str], tmp_path: Path) -> None:
    started = time.monotonic()
    with pytest.raises(OutputLockedError) as raised, output_lock(tmp_path / "out", "sft"):
        pytest.fail("two writers held the lock")
    assert time.monotonic() - started < 60  # the holder keeps the lock for 600 s: a writer that waited would not
    message = str(raised.value)
    assert f"{tmp_path / 'out'} is being written by another process: pid {holder.pid} on host " in message
    assert f"host {socket.gethostname()} (stage holder, started 20" in message
    assert "another --out" in message and str(lock_path(tmp_path / "out")) in message


def test_a_lock_left_by_a_killed_process_is_taken_over(
    holder: subprocess.Popen[str], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    holder.send_signal(signal.SIGKILL)
    holder.wait(timeout=30)
    out = tmp_path / "out"
    assert lock_pid(out) == holder.pid  # the stale file stays behind
    with caplog.at_level(logging.WARNING, logger="rlhf_core.output_lock"), output_lock(out, "sft") as taken:
        assert lock_pid(out) == os.getpid() == taken.pid
    assert f"taking over the lock left by pid {holder.pid} on host" in caplog.text
    assert not lock_path(out).exists()  # released and removed


def test_the_lock_is_not_reentrant_and_is_free_again_after_release(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with (
        output_lock(out, "sft"),
        pytest.raises(OutputLockedError, match=f"pid {os.getpid()} "),
        output_lock(out, "sft"),
    ):
        pass
    with output_lock(out, "sft"):
        assert lock_pid(out) == os.getpid()
    assert sorted(path.name for path in tmp_path.iterdir()) == []


def test_stages_refuse_a_locked_output_before_touching_it(
    holder: subprocess.Popen[str], tmp_path: Path, data_dir: Path
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "metrics.json").write_text("{}")
    with pytest.raises(OutputLockedError, match=f"pid {holder.pid}"):
        run_sft(tiny_config(), data_dir, out)
    with pytest.raises(OutputLockedError, match=f"pid {holder.pid}"):
        run_prepare_data(tiny_config(), out, source=str(data_dir / "nowhere.jsonl"))
    assert [path.name for path in out.iterdir()] == ["metrics.json"]


def test_eval_and_score_pairs_refuse_a_locked_output_before_touching_it(
    holder: subprocess.Popen[str], tmp_path: Path, data_dir: Path, models: tuple[Path, Path]
) -> None:
    sft_dir, rm_dir = models
    out = tmp_path / "out"
    out.mkdir()
    (out / "metrics.json").write_text("{}")
    with pytest.raises(OutputLockedError, match=f"pid {holder.pid} on host .* \\(stage holder"):
        run_evaluate(tiny_config(), data_dir, sft_dir, sft_dir, out, rm_dir=rm_dir)
    with pytest.raises(OutputLockedError, match=f"pid {holder.pid}"):
        score_pair_file(tiny_config(), rm_dir, str(data_dir / "rm_val.parquet"), out)
    assert [path.name for path in out.iterdir()] == ["metrics.json"]
    assert score_pair_file(tiny_config(), rm_dir, str(data_dir / "rm_val.parquet")).accuracy.pairs > 0  # no --out


# --- real processes ---------------------------------------------------------------------------------------


@pytest.mark.slow
def test_two_rlhf_sft_runs_into_one_out_dir_cannot_mix_their_outputs(data_dir: Path, tmp_path: Path) -> None:
    """The first writer holds the lock (paused while the second starts, so they overlap for sure); the
    second fails at once naming it, and the output is wholly the first one's."""
    out = tmp_path / "sft"
    first = rlhf_sft(data_dir, out, "sft.lr=0.001")
    wait_for(lambda: lock_pid(out) == first.pid or first.poll() is not None, "the first run to take the lock")
    first.send_signal(signal.SIGSTOP)
    try:
        second = rlhf_sft(data_dir, out, "sft.lr=0.002")
        _, second_err = second.communicate(timeout=240)
    finally:
        first.send_signal(signal.SIGCONT)
    first_out, first_err = first.communicate(timeout=300)

    assert second.returncode == 1
    assert f"is being written by another process: pid {first.pid} on host {socket.gethostname()}" in second_err
    assert first.returncode == 0, first_err
    assert "sft: trained 4 steps" in first_out
    assert json.loads((out / "history.params.json").read_text())["loop"]["lr"] == 0.001
    recorded = json.loads((out / "checkpoints" / "run_inputs.json").read_text())
    assert recorded["settings"]["sft"]["lr"] == 0.001
    assert not lock_path(out).exists()


@pytest.mark.slow
def test_a_sigkill_while_the_stage_holds_the_lock_is_followed_by_a_successful_rerun(
    data_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "sft"
    settings = ("sft.checkpoint_every=1",)  # 4 steps (tiny.yaml): the kill comes after the first
    victim = rlhf_sft(data_dir, out, *settings)
    wait_for(lambda: complete_checkpoints(out / "checkpoints"), "the first checkpoint")
    victim.send_signal(signal.SIGKILL)
    victim.communicate(timeout=30)
    assert lock_pid(out) == victim.pid and not (out / "metrics.json").exists()

    rerun = rlhf_sft(data_dir, out, *settings)
    stdout, stderr = rerun.communicate(timeout=300)
    assert rerun.returncode == 0, stderr
    assert f"taking over the lock left by pid {victim.pid} on host" in stderr
    assert "sft: trained 4 steps (resumed from checkpoint step" in stdout
    assert json.loads((out / "metrics.json").read_text())["steps"] == 4
    assert not lock_path(out).exists()


@pytest.mark.slow
def test_two_rlhf_eval_runs_into_one_out_dir_cannot_mix_their_outputs(
    data_dir: Path, models: tuple[Path, Path], tmp_path: Path
) -> None:
    """As for sft: the first evaluation, paused while holding the lock, is refused to the second, and
    the output is wholly the first one's (8 prompts, not the second's 4)."""
    sft_dir, rm_dir = models
    out = tmp_path / "eval"

    def rlhf_eval(max_prompts: int) -> subprocess.Popen[str]:
        return rlhf(
            "eval",
            "-c",
            TINY,
            "-s",
            f"evaluation.max_prompts={max_prompts}",
            "--a",
            sft_dir,
            "--b",
            sft_dir,
            "--allow-same",
            "--rm-dir",
            rm_dir,
            "--data-dir",
            data_dir,
            "--out",
            out,
        )

    first = rlhf_eval(8)
    wait_for(lambda: lock_pid(out) == first.pid or first.poll() is not None, "the first run to take the lock")
    first.send_signal(signal.SIGSTOP)
    try:
        second = rlhf_eval(4)
        _, second_err = second.communicate(timeout=240)
    finally:
        first.send_signal(signal.SIGCONT)
    _, first_err = first.communicate(timeout=300)

    assert second.returncode == 1
    host = socket.gethostname()
    assert f"is being written by another process: pid {first.pid} on host {host} (stage evaluate" in second_err
    assert first.returncode == 0, first_err
    assert json.loads((out / "metrics.json").read_text())["pairs"] == 8
    assert len((out / "generations.jsonl").read_text().splitlines()) == 8
    assert not lock_path(out).exists()
