"""Atomic directory writes leave nothing behind after a kill: the next write of the same directory removes
the temporary siblings of dead writers on this host, puts back an output a killed swap had set aside,
and leaves live writers' and other hosts' directories alone."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from rlhf_core.atomic import atomic_directory, remove_stale_temporaries

WRITE_AND_WAIT = """
import sys, time
from rlhf_core.atomic import atomic_directory
with atomic_directory(sys.argv[1]) as temporary:
    (temporary / "half.bin").write_bytes(b"half written")
    print(temporary.name, flush=True)
    time.sleep(600)
"""


@pytest.fixture
def writer(tmp_path: Path) -> Iterator[subprocess.Popen[str]]:
    """A process in the middle of an atomic write of `tmp_path / "out"`."""
    process = subprocess.Popen(
        [sys.executable, "-c", WRITE_AND_WAIT, str(tmp_path / "out")], stdout=subprocess.PIPE, text=True
    )
    assert process.stdout is not None and process.stdout.readline().startswith(".out.tmp-")
    yield process
    if process.poll() is None:
        process.kill()
    process.wait(timeout=30)


def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
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


def test_an_output_set_aside_by_a_killed_swap_is_put_back(tmp_path: Path) -> None:
    prefix = f"{socket.gethostname()}-{dead_pid()}"
    aside = tmp_path / f".out.old-{prefix}-abc123_x"
    aside.mkdir()
    (aside / "metrics.json").write_text("{}")  # the finished output the swap had moved out of the way
    (tmp_path / f".out.tmp-{prefix}-def456").mkdir()  # the new one it never moved in
    remove_stale_temporaries(tmp_path / "out")
    assert names(tmp_path) == ["out"] and names(tmp_path / "out") == ["metrics.json"]


def test_other_hosts_and_other_outputs_are_not_touched(tmp_path: Path) -> None:
    pid = dead_pid()
    keep = [
        f".out.tmp-another-host-{pid}-abc123",  # its pid means nothing on this host
        f".outer.tmp-{socket.gethostname()}-{pid}-abc123",  # another output's
        ".out.tmp-k2j3h4g5",  # an older version's name: whose it is cannot be told
    ]
    for name in keep:
        (tmp_path / name).mkdir()
    remove_stale_temporaries(tmp_path / "out")
    assert names(tmp_path) == sorted(keep)
