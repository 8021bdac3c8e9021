"""A full or read-only output file system ends a stage command in one line naming the output.

- `naming_failed_writes` blames the file system for an OSError with its errno anywhere in the chain
  (a refused read of an input excepted), for safetensors' quoted "No space left on device (os error
  28)", and for an errno-less RuntimeError (torch's zip writer) when the file system is full; a
  ValueError on a full disk stays itself. The CLI's line names a refused write outside any stage too.
- On a real full tmpfs and a real read-only directory (tests/fixtures/file_systems.py; skipped where
  nothing can be mounted): an atomic write raises `OutputWriteError` naming the output and leaves
  nothing behind; `rlhf prepare-data` and `rlhf sft` exit 1 with one line
  "rlhf: error: cannot write <out>: no space left on device" (or "read-only file system" /
  "permission denied") and no metrics.json; an ENOSPC without a file name (`os.write`) is named too.
- `rlhf run` (slow): a runs directory on a 2 MiB tmpfs stops at SFT, unretried, its last line naming the
  stage and its output; a read-only one names the first stage and its output.
"""

from __future__ import annotations

import errno
import os
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from fixtures.commands import run_main
from fixtures.file_systems import full_tmpfs, read_only_directory, small_tmpfs
from fixtures.paths import PARAMS, TINY
from fixtures.tiny_ppo import hh_pair
from rlhf_core.atomic import atomic_directory, atomic_write_text
from rlhf_core.layout import METRICS_FILE
from rlhf_core.write_failures import OutputWriteError, naming_failed_writes

SAFETENSORS_DISK_FULL = "Error while serializing: I/O error: No space left on device (os error 28)"
TORCH_WRITER_FAILURE = "[enforce fail at inline_container.cc:672] . unexpected pos 13568 vs 13460"


def raised_inside(path: Path, error: Exception) -> BaseException:
    """What `naming_failed_writes(path)` lets out when its block raises `error`."""
    with pytest.raises(Exception) as caught, naming_failed_writes(path):
        raise error
    return caught.value


def test_an_errno_anywhere_in_the_chain_names_the_output(tmp_path: Path) -> None:
    bare = OSError(errno.ENOSPC, "No space left on device")  # os.write: no file name
    wrapped = RuntimeError("saving failed")
    wrapped.__cause__ = bare
    denied = PermissionError(errno.EACCES, "Permission denied", str(tmp_path / "out" / "model.safetensors"))
    read_only = OSError(errno.EROFS, "Read-only file system")
    for error, reason in (
        (bare, "no space left on device"),
        (wrapped, "no space left on device"),
        (denied, "permission denied"),
        (read_only, "read-only file system"),
    ):
        named = raised_inside(tmp_path / "out", error)
        assert isinstance(named, OutputWriteError) and named.__cause__ is error
        assert str(named) == f"cannot write {tmp_path / 'out'}: {reason}"


def test_a_refused_read_of_an_input_is_not_blamed_on_the_output(tmp_path: Path) -> None:
    unreadable_input = PermissionError(errno.EACCES, "Permission denied", str(tmp_path / "pairs.jsonl"))
    assert raised_inside(tmp_path / "out", unreadable_input) is unreadable_input
    for own in (tmp_path / ".out.lock", tmp_path / "out", tmp_path):  # its lock, itself, a directory above it
        refused = PermissionError(errno.EACCES, "Permission denied", str(own))
        assert str(raised_inside(tmp_path / "out", refused)) == f"cannot write {tmp_path / 'out'}: permission denied"


def test_the_cli_line_names_a_refused_write_outside_any_stage() -> None:
    """A log file or cache on a full or read-only disk: "cannot write <its path>"; a refused read stays itself."""
    from rlhf_cli.main import error_line

    read_only = OSError(errno.EROFS, "Read-only file system", "/srv/runs/logs")
    assert error_line(read_only) == "cannot write /srv/runs/logs: read-only file system"
    unreadable = PermissionError(errno.EACCES, "Permission denied", "/srv/pairs.jsonl")
    assert error_line(unreadable) == str(unreadable)


def test_a_library_quoting_the_disk_full_error_is_named(tmp_path: Path) -> None:
    named = raised_inside(tmp_path / "out", Exception(SAFETENSORS_DISK_FULL))
    assert str(named) == f"cannot write {tmp_path / 'out'}: no space left on device"


def test_other_errors_pass_unchanged(tmp_path: Path) -> None:
    """A file system with room: neither a ValueError nor torch's errno-less writer error is blamed on it."""
    for error in (ValueError("bad value"), RuntimeError(TORCH_WRITER_FAILURE), FileNotFoundError(2, "gone", "x")):
        assert raised_inside(tmp_path / "out", error) is error


def test_on_a_full_disk_only_writer_errors_are_blamed_on_it(tmp_path: Path) -> None:
    with full_tmpfs(tmp_path / "disk") as disk:
        assert str(raised_inside(disk / "out", RuntimeError(TORCH_WRITER_FAILURE))) == (
            f"cannot write {disk / 'out'}: no space left on device"
        )
        config_error = ValueError("sft.lr: must be positive")
        assert raised_inside(disk / "out", config_error) is config_error


def test_a_torch_save_into_a_full_disk_names_the_output_and_leaves_nothing(tmp_path: Path) -> None:
    """torch's writer says only "unexpected pos"; the atomic writer checks the disk before its cleanup
    frees what the failed write took, and removes its temporary directory."""
    with full_tmpfs(tmp_path / "disk", size_kib=1024, left_bytes=256 * 1024) as disk:
        with pytest.raises(OutputWriteError) as failed, atomic_directory(disk / "model") as temporary:
            torch.save(torch.zeros(512 * 1024), temporary / "weights.pt")  # 2 MiB into 256 KiB
        assert str(failed.value) == f"cannot write {disk / 'model'}: no space left on device"
        assert sorted(path.name for path in disk.iterdir()) == ["filler"]


def test_an_atomic_file_in_a_read_only_directory_names_it(tmp_path: Path) -> None:
    with read_only_directory(tmp_path / "ro") as directory:
        with pytest.raises(OutputWriteError) as failed:
            atomic_write_text(directory / METRICS_FILE, "{}")
        reason = "read-only file system" if os.geteuid() == 0 else "permission denied"
        assert str(failed.value) == f"cannot write {directory / METRICS_FILE}: {reason}"
        assert not any(directory.iterdir())


@pytest.fixture
def pairs_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """40 HH-style pairs; the working directory (where runs/logs go) is tmp_path/work."""
    import json

    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    source = tmp_path / "pairs.jsonl"
    source.write_text("".join(json.dumps(hh_pair(i)) + "\n" for i in range(40)))
    return source


def prepare_data_into(out: Path, pairs_file: Path) -> list[str]:
    return ["prepare-data", "-c", str(TINY), "--params", str(PARAMS), "--data", str(pairs_file), "--out", str(out)]


@pytest.mark.slow  # the CLI imports MLflow for its library log, which takes seconds
def test_prepare_data_onto_a_full_disk_is_one_line_naming_the_output(
    tmp_path: Path, pairs_file: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with full_tmpfs(tmp_path / "disk", size_kib=256, left_bytes=16 * 1024) as disk:
        status, stderr = run_main(prepare_data_into(disk / "data", pairs_file), monkeypatch, capsys)
        assert status == 1
        assert stderr.splitlines() == [f"rlhf: error: cannot write {disk / 'data'}: no space left on device"]
        assert sorted(path.name for path in disk.iterdir()) == ["filler"]  # no output, no temporary, no lock


@pytest.mark.slow  # the CLI imports MLflow for its library log, which takes seconds
def test_prepare_data_into_a_read_only_directory_is_one_line_naming_the_output(
    tmp_path: Path, pairs_file: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with read_only_directory(tmp_path / "ro") as directory:
        status, stderr = run_main(prepare_data_into(directory / "data", pairs_file), monkeypatch, capsys)
        reason = "read-only file system" if os.geteuid() == 0 else "permission denied"
        assert status == 1
        assert stderr.splitlines() == [f"rlhf: error: cannot write {directory / 'data'}: {reason}"]
        assert not any(directory.iterdir())


@pytest.mark.slow  # the CLI imports MLflow for its library log, which takes seconds
def test_a_disk_full_without_a_file_name_still_names_the_output(
    tmp_path: Path, pairs_file: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Simulated, for machines that cannot mount a tmpfs: the output lock's write of its holder record
    (`os.write`) fails as a full disk does, with no file name."""
    import rlhf_core.file_lock

    def disk_full(descriptor: int, holder: object) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(rlhf_core.file_lock, "write_holder", disk_full)
    status, stderr = run_main(prepare_data_into(tmp_path / "data", pairs_file), monkeypatch, capsys)
    assert status == 1
    assert stderr.splitlines() == [f"rlhf: error: cannot write {tmp_path / 'data'}: no space left on device"]
    assert not (tmp_path / "data").exists() and not (tmp_path / ".data.lock").exists()


@pytest.mark.slow  # trains the tiny model until its first checkpoint
def test_sft_onto_a_full_disk_is_one_line_and_leaves_no_metrics(
    tmp_path: Path, data_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """2 MiB: room for the history files, not for the first checkpoint (safetensors fails, quoting errno 28)."""
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    with small_tmpfs(tmp_path / "disk", size_kib=2048) as disk:
        argv = [
            "sft",
            "-c",
            str(TINY),
            "--params",
            str(PARAMS),
            "--data-dir",
            str(data_dir),
            "--out",
            str(disk / "sft"),
        ]
        status, stderr = run_main(argv, monkeypatch, capsys)
        assert status == 1
        assert stderr.splitlines() == [f"rlhf: error: cannot write {disk / 'sft'}: no space left on device"]
        assert not (disk / "sft" / METRICS_FILE).exists() and not (disk / "sft" / "model").exists()


@pytest.fixture
def run_tiny_pipeline(
    pairs_file: Path, mlflow_store: object, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> Callable[[Path], tuple[int, str]]:
    """`rlhf run` on the tiny configuration into a runs directory, in this process (tracked in the test's
    MLflow store): its status and stderr."""

    def run(runs_dir: Path) -> tuple[int, str]:
        argv = ["run", "-c", str(TINY), "--params", str(PARAMS), "--data", str(pairs_file)]
        return run_main([*argv, "--runs-dir", str(runs_dir)], monkeypatch, capsys)

    return run


@pytest.mark.slow  # runs the pipeline's flow against the test Prefect server up to its SFT stage
def test_rlhf_run_onto_a_full_disk_stops_at_once_naming_the_stage_output(
    tmp_path: Path, run_tiny_pipeline: Callable[[Path], tuple[int, str]]
) -> None:
    """2 MiB for the runs directory: data preparation fits, SFT's first checkpoint does not. The stage is
    not retried (a full disk stays full), its output has no metrics.json, and the last line names it."""
    with small_tmpfs(tmp_path / "disk", size_kib=2048) as disk:
        status, stderr = run_tiny_pipeline(disk / "runs")
        assert status == 1
        (run_dir,) = [
            path for path in (disk / "runs").iterdir() if not path.name.startswith(".") and path.name != "logs"
        ]
        # The traceback goes to the run's log file, named in the line if that file could take it.
        last = f"rlhf: error: stage sft failed: cannot write {run_dir / 'sft'}: no space left on device"
        assert re.fullmatch(rf"{re.escape(last)}( \(traceback in .+\))?", stderr.splitlines()[-1]), stderr[-2000:]
        assert "Retry" not in stderr and "Logging error" not in stderr
        assert (run_dir / "data" / METRICS_FILE).exists() and not (run_dir / "sft" / METRICS_FILE).exists()


@pytest.mark.slow  # runs the pipeline's flow against the test Prefect server
def test_rlhf_run_into_a_read_only_runs_directory_is_one_line_naming_it(
    tmp_path: Path, run_tiny_pipeline: Callable[[Path], tuple[int, str]]
) -> None:
    with read_only_directory(tmp_path / "ro") as directory:
        status, stderr = run_tiny_pipeline(directory / "runs")
        reason = "read-only file system" if os.geteuid() == 0 else "permission denied"
        assert status == 1
        # The first stage's output (runs/<run id>/data) is the first thing written, and the line names it
        # (and no log file: the runs directory cannot take one).
        assert re.fullmatch(
            rf"rlhf: error: stage prepare-data failed: cannot write "
            rf"{re.escape(str(directory))}/runs/[\w-]+/data: {reason}",
            stderr.splitlines()[-1],
        ), stderr[-2000:]
        assert "Logging error" not in stderr
        assert not any(directory.iterdir())
