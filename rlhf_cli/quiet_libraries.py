"""The libraries' own progress bars and notices, switched off at the source when nobody watches a terminal.

The project's bars are off when stderr is not a terminal or RLHF_QUIET is set (rlhf_core/progress.py);
the libraries under it draw bars of their own regardless, with a carriage return per update, into
whatever file stderr is: transformers' "Loading weights" and "Writing model shards", huggingface_hub's
downloads, MLflow's "Downloading artifacts". Prefect prints its anonymous-usage notice on its first
import when stdout or stderr is a terminal, so also when only stderr is redirected. Each offers a switch,
set here as an environment variable (unless the user set it), so that the processes a command starts
inherit it: the deepspeed launcher's ranks, the flow runs of `rlhf serve`, the DVC commands.

What has no switch is diverted instead (rlhf_cli/library_logs.py): DeepSpeed's "Setting accelerator to
CPU" warning (its logger's level is reset when DeepSpeed creates it, on import, just before it warns;
DS_ACCELERATOR would skip the detection but also force the accelerator), MLflow's and transformers'
warnings, and Prefect's "Still processing items" while its events are sent.
"""

from __future__ import annotations

import os
import sys

from rlhf_core.progress import bars_enabled

QUIET_LIBRARY_SETTINGS = {
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",  # huggingface_hub's bars, and transformers' (it follows hub's switch)
    "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false",  # MLflow's artifact upload and download bars
    "DO_NOT_TRACK": "1",  # Prefect's client telemetry, and with it the first-run notice
}


def silence_libraries() -> None:
    """Switch the libraries' bars and notices off: QUIET_LIBRARY_SETTINGS, each unless already set, and
    transformers' bars in this process if transformers was imported before (it reads the switch once, on
    import; a later import reads the variable, so it is not imported here for nothing)."""
    for name, value in QUIET_LIBRARY_SETTINGS.items():
        os.environ.setdefault(name, value)
    if "transformers" in sys.modules:
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()  # also huggingface_hub's; its variable, set to "0", wins


def silence_libraries_unless_watched() -> None:
    """`silence_libraries()` when the project's bars are off too (`bars_enabled()`): stderr is not a
    terminal, or RLHF_QUIET is set."""
    if not bars_enabled():
        silence_libraries()
