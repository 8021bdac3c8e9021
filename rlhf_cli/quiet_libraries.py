"""The libraries' own progress bars and notices, switched off at the source when nobody watches a terminal.

The project's bars are off when stderr is not a terminal or RLHF_QUIET is set (rlhf_core/progress.py);
the libraries under it draw bars of their own regardless, with a carriage return per update, into
whatever file stderr is: transformers' "Loading weights" and "Writing model shards", huggingface_hub's
downloads, MLflow's "Downloading artifacts". Prefect prints its anonymous-usage notice on its first
import when stdout or stderr is a terminal, so also when only stderr is redirected. Each offers a switch,
set here as an environment variable (unless the user set it), so that the processes a command starts
inherit it: the deepspeed launcher's ranks, the flow runs of `rlhf serve`, the DVC commands.

DeepSpeed warns "Setting accelerator to CPU" whenever it is imported on a machine without an accelerator,
and transformers' `save_pretrained` imports it (through accelerate) in every stage that saves a model. Its
switch, DS_ACCELERATOR, skips the detection by naming the accelerator, so it is set to `cpu` only where
the detection would find nothing (`deepspeed_cpu_setting`); a machine with a GPU keeps the detection.

MLflow also writes two lines to stdout ("View run ... at", "View experiment at") whenever a run ends on a
tracking server: one pair per stage, four for registration. The command's summary names the pipeline's
MLflow run, so these are switched off in every case, watched or not (`hide_mlflow_run_links`).

What has no switch is diverted instead (rlhf_cli/library_logs.py): MLflow's and transformers' warnings,
and Prefect's "Still processing items" while its events are sent. (The diversion also catches DeepSpeed's
warning where DS_ACCELERATOR was set by the user to something else.)
"""

from __future__ import annotations

import importlib.util
import os
import sys

from rlhf_core.progress import bars_enabled

QUIET_LIBRARY_SETTINGS = {
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",  # huggingface_hub's bars, and transformers' (it follows hub's switch)
    "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false",  # MLflow's artifact upload and download bars
    "DO_NOT_TRACK": "1",  # Prefect's client telemetry, and with it the first-run notice
}

MLFLOW_RUN_LINKS_SETTING = ("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")

# Packages whose import DeepSpeed's accelerator detection tries (deepspeed/accelerator/real_accelerator.py);
# torch's own devices (CUDA, XPU, MPS) are covered by `torch.accelerator`.
DEEPSPEED_ACCELERATOR_PACKAGES = (
    "intel_extension_for_pytorch",
    "torch_npu",
    "torch_sdaa",
    "habana_frameworks",
    "torch_mlu",
    "torch_supa",
    "torch_xmlir",
)


def deepspeed_cpu_setting() -> dict[str, str]:
    """{"DS_ACCELERATOR": "cpu"} where DeepSpeed's detection would settle on the CPU anyway (torch sees no
    accelerator and none of DeepSpeed's accelerator packages is installed), else nothing. Imports torch
    here, not at the top: `rlhf --help` needs neither."""
    import torch

    if torch.accelerator.is_available():
        return {}
    if any(importlib.util.find_spec(name) is not None for name in DEEPSPEED_ACCELERATOR_PACKAGES):
        return {}
    return {"DS_ACCELERATOR": "cpu"}


def silence_libraries() -> None:
    """Switch the libraries' bars and notices off: QUIET_LIBRARY_SETTINGS and `deepspeed_cpu_setting()`, each
    unless already set, and transformers' bars in this process if transformers was imported before (it reads the switch
    once, on
    import; a later import reads the variable, so it is not imported here for nothing)."""
    for name, value in (QUIET_LIBRARY_SETTINGS | deepspeed_cpu_setting()).items():
        os.environ.setdefault(name, value)
    if "transformers" in sys.modules:
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()  # also huggingface_hub's; its variable, set to "0", wins


def silence_libraries_unless_watched() -> None:
    """`silence_libraries()` when the project's bars are off too (`bars_enabled()`): stderr is not a
    terminal, or RLHF_QUIET is set."""
    if not bars_enabled():
        silence_libraries()


def hide_mlflow_run_links() -> None:
    """Switch off MLflow's "View run" and "View experiment" lines on stdout (module docstring), unless the
    user set the switch; the processes a command starts inherit it."""
    os.environ.setdefault(*MLFLOW_RUN_LINKS_SETTING)
