"""The multi-process launcher (rlhf_core/distributed/launcher.py) with the real `deepspeed` launcher.

Two CPU processes run tests/scripts/distributed_rank_probe.py: every rank's output reaches the callback
with the rank it came from, and when a rank raises, the error names that rank and its message (not the
secondary error of the rank that lost its peer), with the rank's last log lines; a rank that dies without a Python
error is shown by every rank's last lines.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from fixtures.paths import SCRIPTS
from rlhf_core.config import DistributedConfig
from rlhf_core.distributed.launcher import Launch, LaunchStoppedError, RankFailedError, launcher_command, run_launch

TWO_RANKS = DistributedConfig(num_processes=2, master_port=29613)


def probe_launch(tmp_path: Path, *args: str, distributed: DistributedConfig = TWO_RANKS) -> Launch:
    return Launch(
        module="distributed_rank_probe",
        args=list(args),
        distributed=distributed,
        log_dir=tmp_path / "logs",
        env={"PYTHONPATH": str(SCRIPTS), "OMP_NUM_THREADS": "1"},
    )


def test_command_starts_the_module_on_every_gpu_without_local_rank_argument(tmp_path: Path) -> None:
    spec = probe_launch(tmp_path, "--x", "1")
    command = launcher_command(spec)
    assert command[1:4] == ["-u", "-m", "deepspeed.launcher.runner"]
    assert command[command.index("--num_gpus") + 1] == "2"
    assert command[command.index("--master_port") + 1] == "29613"
    assert "--no_local_rank" in command
    assert command[command.index("--module") + 1 :] == ["distributed_rank_probe", "--x", "1"]


def test_multi_node_command_names_the_hostfile(tmp_path: Path) -> None:
    spec = Launch(
        module="m",
        args=[],
        distributed=DistributedConfig(num_processes=8, num_nodes=2, hostfile="/etc/hosts.ds", master_addr="10.0.0.1"),
        log_dir=tmp_path,
    )
    command = launcher_command(spec)
    assert command[command.index("--num_nodes") + 1] == "2"
    assert command[command.index("--hostfile") + 1] == "/etc/hosts.ds"
    assert command[command.index("--master_addr") + 1] == "10.0.0.1"


@pytest.mark.slow
def test_failing_rank_is_named_with_its_message_and_every_rank_is_streamed(tmp_path: Path) -> None:
    lines: list[tuple[int | None, str]] = []
    with pytest.raises(RankFailedError) as raised:
        run_launch(
            probe_launch(tmp_path, "--fail-rank", "1", "--message", "bad shard 7"),
            lambda rank, line: lines.append((rank, line)),
        )
    error = raised.value
    assert error.rank == 1
    assert error.error_type == "ValueError"
    assert str(error).startswith("rank 1 of 2 failed: ValueError: bad shard 7")
    assert any("ValueError: bad shard 7" in line for line in error.tail)  # the rank's traceback
    assert (0, "hello from rank 0 of 2") in lines
    assert (1, "hello from rank 1 of 2") in lines
    assert any(rank is None for rank, _ in lines)  # the launcher's own output


@pytest.mark.slow
def test_a_rank_that_aborts_is_shown_by_every_ranks_last_lines(tmp_path: Path) -> None:
    with pytest.raises(RankFailedError) as raised:
        run_launch(probe_launch(tmp_path, "--fail-rank", "1", "--message", "about to abort", "--abort"), print)
    error = raised.value
    assert (error.rank, error.error_type) == (None, None)
    message = str(error)
    assert "no rank recorded an error" in message
    rank_1 = message.split("--- last lines of rank 1 ---\n", 1)[1]
    assert "about to abort" in rank_1
    assert "hello from rank 0 of 2" in message.split("--- last lines of rank 0 ---\n", 1)[1]


def test_a_world_of_one_runs_the_module_directly(tmp_path: Path) -> None:
    spec = probe_launch(tmp_path, "--x", "1", distributed=DistributedConfig(num_processes=1))
    assert launcher_command(spec) == [sys.executable, "-u", "-m", "distributed_rank_probe", "--x", "1"]


@pytest.mark.slow
def test_a_failing_world_of_one_is_named_with_its_message_and_log(tmp_path: Path) -> None:
    one = DistributedConfig(num_processes=1)
    with pytest.raises(RankFailedError) as raised:
        run_launch(probe_launch(tmp_path, "--fail-rank", "0", "--message", "bad shard 3", distributed=one), print)
    assert str(raised.value).startswith("rank 0 of 1 failed: ValueError: bad shard 3")
    assert any("ValueError: bad shard 3" in line for line in raised.value.tail)  # from the launcher's log


@pytest.mark.slow
def test_a_stopped_launch_leaves_no_process_running(tmp_path: Path) -> None:
    """`stop` turning true (the stage beside failed) terminates the launch: here a rank that would wait a
    minute for a rank beyond its world of one."""
    one = DistributedConfig(num_processes=1)
    lines: list[str] = []
    with pytest.raises(LaunchStoppedError):
        run_launch(
            probe_launch(tmp_path, "--fail-rank", "1", "--message", "never", distributed=one),
            lambda rank, line: lines.append(line),
            stop=lambda: any(line.startswith("pid ") for line in lines),
        )
    (pid,) = [int(line.split()[1]) for line in lines if line.startswith("pid ")]
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # terminated and reaped
