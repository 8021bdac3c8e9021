"""Find the Hugging Face model directory behind what a user names: a stage output or a plain model dir.

A stage output directory (`artifacts/ppo`, `artifacts/sft`, `artifacts/reward`) holds its model in
`model/` and is complete only once its `metrics.json` exists; a model from an unfinished stage is
refused rather than evaluated. MLflow `models:/name@alias` URIs are resolved to a local directory by
the caller (the Prefect tasks), which keeps this library free of MLflow.
"""

from __future__ import annotations

from pathlib import Path

from rlhf_core.layout import METRICS_FILE, MODEL_DIR

CAUSAL_LM_MARKER = "config.json"
REWARD_MODEL_MARKER = "head_config.json"


def resolve_model_dir(path: str | Path, marker_file: str = CAUSAL_LM_MARKER) -> Path:
    """`path/model` for a completed stage output, `path` for a model directory holding `marker_file`."""
    text = str(path)
    if text.startswith("models:/"):
        raise ValueError(
            f"{text}: an MLflow registry URI; download it to a local directory first (the Prefect "
            "evaluation tasks do this), then pass that directory"
        )
    path = Path(path)
    if (path / MODEL_DIR / marker_file).is_file():
        if not (path / METRICS_FILE).is_file():
            raise FileNotFoundError(
                f"{path} is an unfinished stage output (it has model/ but no {METRICS_FILE}); "
                "rerun that stage to completion first"
            )
        return path / MODEL_DIR
    if (path / marker_file).is_file():
        return path
    raise FileNotFoundError(
        f"{path}: neither a stage output directory (with model/{marker_file}) nor a model directory "
        f"(with {marker_file})"
    )
