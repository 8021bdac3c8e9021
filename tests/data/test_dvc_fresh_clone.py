"""A fresh clone and the raw data: `rlhf data status` says in one line where data/raw
stands and what to do first, with exit 0, in each state a checkout can be in: no data in the commit
(a fresh clone of this repository), recorded but not pulled, edited, and a version ready for
`dvc repro`. In a fresh clone of this repository `dvc pull` and `dvc status` exit 0 as well."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fixtures.commands import RLHF_COMMAND
from fixtures.paths import ROOT
from tasks.data.dvc_data import data_version, dvc_add, raw_data_status

pytestmark = pytest.mark.slow  # git and dvc subprocesses

GIT_IDENTITY = {f"GIT_{role}_{key}": "test" for role in ("AUTHOR", "COMMITTER") for key in ("NAME", "EMAIL")}


def run(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **GIT_IDENTITY, "PYTHONPATH": str(ROOT)}
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=300, check=False)


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """An empty git + DVC repository with a data/ directory."""
    project = tmp_path / "project"
    (project / "data").mkdir(parents=True)
    for command in (["git", "init", "-q"], [sys.executable, "-m", "dvc", "init", "-q"]):
        assert run(command, project).returncode == 0
    return project


def test_data_status_names_each_state_and_what_to_do_first(project: Path) -> None:
    raw = project / "data" / "raw"
    assert raw_data_status(raw).startswith(
        f"no raw data yet: this commit has no {raw}.dvc; add a preference file with `rlhf data add FILE`"
    )
    raw.mkdir()
    (raw / "pairs.jsonl").write_text('{"prompt": "p", "chosen": "a", "rejected": "b"}\n')
    version = dvc_add(raw)
    assert raw_data_status(raw).startswith(f"{raw} is data version {version}, as {raw}.dvc records")
    (raw / "pairs.jsonl").write_text('{"prompt": "q", "chosen": "a", "rejected": "b"}\n')
    assert raw_data_status(raw).startswith(f"{raw} differs from the version {raw}.dvc records ({version})")
    shutil.rmtree(raw)
    assert raw_data_status(raw) == f"{raw} is not pulled: run `dvc pull {raw}.dvc` (data version {version})"
    assert data_version(raw) == version


def test_a_fresh_clone_says_what_to_do_first_and_dvc_pull_and_status_exit_0(tmp_path: Path) -> None:
    clone = tmp_path / "clone"
    assert run(["git", "clone", "-q", str(ROOT), str(clone)], tmp_path).returncode == 0
    status = run([*RLHF_COMMAND, "data", "status"], clone)
    assert status.returncode == 0, status.stderr
    assert status.stdout.splitlines() == [
        "no raw data yet: this commit has no data/raw.dvc; add a preference file with `rlhf data add FILE` "
        "(data/README.md), then `dvc repro` prepares it and trains on it"
    ]
    for command in (["pull"], ["status"]):  # nothing to pull (no raw data, no DVC-cached stage output)
        completed = run([sys.executable, "-m", "dvc", *command], clone)
        assert completed.returncode == 0, f"dvc {command[0]}: {completed.stderr}"
