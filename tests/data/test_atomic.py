"""Atomic writes leave nothing behind after a kill: the next write of the same directory (or file) removes
the temporary siblings of dead writers on this host, puts back an output a killed swap had set aside,
and leaves live writers' and other hosts' temporaries alone."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from rlhf_core.atomic import atomic_directory, atomic_file, atomic_write_text, remove_stale_temporaries

WRITE_AND_WAIT = """
import sys, time
from rlhf_core.atomic import atomic_directory
with atomic_directory(sys.argv[1]) as temporary:
    (temporary / "half.bin").write_bytes(b"half written")
    print(temporary.name, flush=True)
    time.sleep(600)
"""
WRITE_FILE_AND_WAIT = """
import sys, time
from rlhf_core.atomic import atomic_file
with atomic_file(sys.argv[1]) as temporary:
    temporary.write_text("half written")
    print(temporary.name, flush=True)
    time.sleep(600)
"""


def start_writer(script: str, target: Path) -> subprocess.Popen[str]:
    """A process in the middle of an atomic write of `target` (it prints its temporary's name)."""
    process = subprocess.Popen([sys.executable, "-c", script, str(target)], stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None and process.stdout.readline().startswith(f".{target.name}.tmp-")
    return process


@pytest.fixture
def file_writer(tmp_path: Path) -> Iterator[subprocess.Popen[str]]:
    """A process in the middle of an atomic write of the file `tmp_path / "metrics.json"`."""
    process = start_writer(WRITE_FILE_AND_WAIT, tmp_path / "metrics.json")
    yield process
    if process.poll() is None:
        process.kill()
    process.wait(timeout=30)


@pytest.fixture
def writer(tmp_path: Path) -> Iterator[subprocess.Popen[str]]:
    """A process in the middle of an atomic write of `tmp_path / "out"`."""
    process = start_writer(WRITE_AND_WAIT, tmp_path / "out")
    yield process
    if process.poll() is None:
        process.kill()
    process.wait(timeout=30)


@pytest.fixture
def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped); a fixture, so the test body starts no process."""
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


def names(directory: Path) -> list[str]:
    return sorted(path.name for path in directory.iterdir())


def test_a_killed_writers_temporary_directory_is_removed_by_the_next_write(
    writer: subprocess.Popen[str], tmp_path: Path
) -> None:
    (leftover,) = names(tmp_path)
    assert leftover.startswith(f".out.tmp-{socket.gethostname()}-{writer.pid}-")
    writer.send_signal(signal.SIGKILL)
    writer.wait(timeout=30)
    assert names(tmp_path) == [leftover]  # a killed process cannot clean up after itself
    with atomic_directory(tmp_path / "out") as temporary:
        (temporary / "done.txt").write_text("complete")
    assert names(tmp_path) == ["out"]
    assert names(tmp_path / "out") == ["done.txt"]


def test_a_live_writers_temporary_directory_is_left_alone(writer: subprocess.Popen[str], tmp_path: Path) -> None:
    (live,) = names(tmp_path)
    with atomic_directory(tmp_path / "out") as temporary:
        (temporary / "done.txt").write_text("complete")
    assert names(tmp_path) == [live, "out"]


def test_an_output_set_aside_by_a_killed_swap_is_put_back(tmp_path: Path, dead_pid: int) -> None:
    prefix = f"{socket.gethostname()}-{dead_pid}"
    aside = tmp_path / f".out.old-{prefix}-abc123_x"
    aside.mkdir()
    (aside / "metrics.json").write_text("{}")  # the finished output the swap had moved out of the way
    (tmp_path / f".out.tmp-{prefix}-def456").mkdir()  # the new one it never moved in
    remove_stale_temporaries(tmp_path / "out")
    assert names(tmp_path) == ["out"] and names(tmp_path / "out") == ["metrics.json"]


def test_other_hosts_and_other_outputs_are_not_touched(tmp_path: Path, dead_pid: int) -> None:
    pid = dead_pid
    keep = [
        f".out.tmp-another-host-{pid}-abc123",  # its pid means nothing on this host
        f".outer.tmp-{socket.gethostname()}-{pid}-abc123",  # another output's
        ".out.tmp-k2j3h4g5",  # an older version's name: whose it is cannot be told
    ]
    for name in keep:
        (tmp_path / name).mkdir()
    remove_stale_temporaries(tmp_path / "out")
    assert names(tmp_path) == sorted(keep)


# --- files --------------------------------------------------------------------------------------------------


@pytest.mark.slow  # a writer process
def test_a_killed_writers_temporary_file_is_removed_by_the_next_write(
    file_writer: subprocess.Popen[str], tmp_path: Path
) -> None:
    (leftover,) = names(tmp_path)
    assert leftover.startswith(f".metrics.json.tmp-{socket.gethostname()}-{file_writer.pid}-")
    file_writer.send_signal(signal.SIGKILL)
    file_writer.wait(timeout=30)
    assert names(tmp_path) == [leftover]
    atomic_write_text(tmp_path / "metrics.json", "{}\n")
    assert names(tmp_path) == ["metrics.json"]
    assert (tmp_path / "metrics.json").read_text() == "{}\n"


@pytest.mark.slow  # a writer process
def test_a_live_writers_temporary_file_is_left_alone(file_writer: subprocess.Popen[str], tmp_path: Path) -> None:
    (live,) = names(tmp_path)
    atomic_write_text(tmp_path / "metrics.json", "{}\n")
    assert names(tmp_path) == [live, "metrics.json"]


def test_a_failed_file_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path: Path) -> None:
    target = atomic_write_text(tmp_path / "report.md", "old\n")
    with pytest.raises(RuntimeError, match="plot failed"), atomic_file(target) as temporary:
        temporary.write_text("half")
        raise RuntimeError("plot failed")
    assert names(tmp_path) == ["report.md"] and target.read_text() == "old\n"
    assert target.stat().st_mode & 0o777 == 0o644  # an ordinary file, not mkstemp's owner-only one
