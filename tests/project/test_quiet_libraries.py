"""The libraries' notices switched off at the source (rlhf_cli/quiet_libraries.py): DeepSpeed's accelerator
warning, which `rlhf serve`'s flow runs inherit the switch for, and only where the switch changes nothing."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from rlhf_cli import quiet_libraries
from rlhf_cli.quiet_libraries import QUIET_LIBRARY_SETTINGS, deepspeed_cpu_setting, silence_libraries

pytestmark = pytest.mark.skipif(torch.accelerator.is_available(), reason="checks a machine without an accelerator")


@pytest.mark.slow
def test_without_an_accelerator_deepspeed_is_told_cpu_and_says_nothing_on_import() -> None:
    assert deepspeed_cpu_setting() == {"DS_ACCELERATOR": "cpu"}
    env = {key: value for key, value in os.environ.items() if key != "DS_ACCELERATOR"}
    probe = (
        "import deepspeed; from deepspeed.accelerator import get_accelerator; print(get_accelerator().device_name())"
    )

    def run(extra: dict[str, str]) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-c", probe]
        return subprocess.run(command, env=env | extra, capture_output=True, text=True, timeout=120, check=True)

    told, detected = run(deepspeed_cpu_setting()), run({})
    assert "Setting accelerator to CPU" in detected.stdout + detected.stderr  # what the switch is for
    assert "Setting accelerator" not in told.stdout + told.stderr
    assert told.stdout.splitlines()[-1] == detected.stdout.splitlines()[-1] == "cpu"  # the same accelerator


def test_an_accelerator_package_or_device_keeps_deepspeed_s_detection(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(quiet_libraries, "DEEPSPEED_ACCELERATOR_PACKAGES", ("json",))  # an installed package
    assert deepspeed_cpu_setting() == {}
    monkeypatch.undo()
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    assert deepspeed_cpu_setting() == {}


def test_silencing_keeps_what_the_user_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DS_ACCELERATOR", "xpu")
    for name in QUIET_LIBRARY_SETTINGS:
        monkeypatch.delenv(name, raising=False)  # restored after the test
    silence_libraries()
    assert os.environ["DS_ACCELERATOR"] == "xpu" and os.environ["DO_NOT_TRACK"] == "1"
