"""The DVC side of data versioning: `dvc add`, `dvc push`, `dvc pull`, and the data version DVC records.

The data version of a DVC-tracked path (`data/raw`) is the md5 DVC wrote into its `.dvc` file
(`data/raw.dvc`, `outs[0].md5`; `<hex>.dir` for a directory): the same value `dvc` itself compares,
pushes under and pulls by, so a model's lineage tag names data that `dvc pull` at that commit brings back.

DVC is driven through its command line (`python -m dvc ...`, the DVC installed with this interpreter),
not through `dvc.repo.Repo`:
- the command line is DVC's documented, stable interface; `dvc.repo.Repo` is an internal class whose
  methods and arguments change between releases;
- a subprocess leaves nothing behind in the caller: DVC in-process configures logging, holds repository
  locks and state databases, and keeps file-system clients alive, none of which a long-lived Prefect
  worker should inherit;
- a failure arrives as DVC's own message, which DvcError carries.
The cost is a second or so of start-up per command, nothing next to hashing and uploading data.
Reading the version needs no DVC at all: a `.dvc` file is a small, documented YAML file.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml

DVC_COMMAND = (sys.executable, "-m", "dvc")
ERROR_TAIL_CHARS = 2000


class DvcError(RuntimeError):
    """A dvc command failed; the message holds the command, its directory and DVC's own output."""


def run_dvc(args: list[str], cwd: Path) -> str:
    """Run `dvc <args>` in `cwd` (inside the repository) and return its standard output."""
    completed = subprocess.run(
        [*DVC_COMMAND, *args], cwd=cwd, stdin=subprocess.DEVNULL, capture_output=True, text=True, check=False
    )
    if completed.returncode != 0:
        output = (completed.stderr.strip() or completed.stdout.strip())[-ERROR_TAIL_CHARS:]
        raise DvcError(f"`dvc {' '.join(args)}` failed in {cwd} with exit code {completed.returncode}: {output}")
    return completed.stdout


def dvc_file(target: Path) -> Path:
    """The `.dvc` file that tracks `target`: `data/raw` -> `data/raw.dvc`."""
    target = Path(target)
    return target.with_name(f"{target.name}.dvc")


def data_version(target: Path) -> str:
    """The md5 DVC recorded for `target` at its last `dvc add` (read from its .dvc file)."""
    path = dvc_file(target)
    if not path.is_file():
        raise FileNotFoundError(f"{target} is not tracked by DVC: {path} does not exist (run `dvc add {target}`)")
    document = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    outs = document.get("outs") if isinstance(document, dict) else None
    if not isinstance(outs, list) or len(outs) != 1 or not outs[0].get("md5"):
        raise ValueError(f"{path}: expected one entry under `outs` with an md5, found {outs!r}")
    return str(outs[0]["md5"])


def dvc_add(target: Path) -> str:
    """`dvc add target`: hash it into the DVC cache, (re)write its .dvc file; returns the new version."""
    target = Path(target)
    run_dvc(["add", target.name], cwd=target.parent)
    return data_version(target)


def dvc_push(target: Path, remote: str | None = None) -> None:
    """Upload `target`'s tracked data to `remote` (default: the repository's default remote)."""
    target = Path(target)
    run_dvc(["push", *_remote_args(remote), dvc_file(target).name], cwd=target.parent)


def dvc_pull(target: Path, remote: str | None = None) -> None:
    """Download `target`'s tracked data from `remote` into the workspace, as its .dvc file pins it."""
    target = Path(target)
    run_dvc(["pull", *_remote_args(remote), dvc_file(target).name], cwd=target.parent)


def workspace_matches(target: Path) -> bool:
    """Whether `target` on disk still is what its .dvc file records (no edits since the last dvc add).

    A data version read from a .dvc file only names the data on disk when this holds.
    """
    target = Path(target)
    status = json.loads(run_dvc(["status", "--json", dvc_file(target).name], cwd=target.parent) or "{}")
    return not status


def raw_data_status(raw_dir: Path) -> str:
    """One line on the raw data and what to do first: none yet in this commit (`rlhf data add FILE`),
    recorded but not pulled (`dvc pull`), edited since its version, or ready for `dvc repro`. A fresh
    clone is in one of the first two states, where `dvc repro` has no data to run on."""
    tracked = dvc_file(raw_dir)
    if not tracked.is_file():
        return (
            f"no raw data yet: this commit has no {tracked}; add a preference file with `rlhf data add FILE` "
            "(data/README.md), then `dvc repro` prepares it and trains on it"
        )
    version = data_version(raw_dir)
    if not Path(raw_dir).is_dir():
        return f"{raw_dir} is not pulled: run `dvc pull {tracked}` (data version {version})"
    if not workspace_matches(raw_dir):
        return (
            f"{raw_dir} differs from the version {tracked} records ({version}): `dvc pull {tracked}` restores "
            f"it, `dvc add {raw_dir}` makes the edits a version"
        )
    return f"{raw_dir} is data version {version}, as {tracked} records: `dvc repro` prepares it and trains on it"


def _remote_args(remote: str | None) -> list[str]:
    return [] if remote is None else ["--remote", remote]
