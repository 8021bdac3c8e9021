"""The options every `rlhf` subcommand shares, and how they turn into a validated `Config`.

`--config FILE` (repeatable overlay on params.yaml), `-s key.path=value` (repeatable override),
`--params FILE` and `--out DIR`; plus the stage-input directories the training commands take.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from rlhf_core.config import Config, load_config

ConfigOption = Annotated[
    Optional[list[Path]],
    typer.Option("--config", "-c", help="Overlay YAML merged over params.yaml (repeatable)."),
]
SetOption = Annotated[
    Optional[list[str]],
    typer.Option("--set", "-s", help="Override one value: key.path=value (repeatable)."),
]
ParamsOption = Annotated[Path, typer.Option("--params", help="The base parameter file.")]
OutOption = Annotated[Optional[Path], typer.Option("--out", help="Output directory of the stage.")]
DataDirOption = Annotated[Path, typer.Option("--data-dir", help="Prepared data (output of prepare-data).")]
SftDirOption = Annotated[Path, typer.Option("--sft-dir", help="Output directory of the sft stage.")]
RmDirOption = Annotated[Path, typer.Option("--rm-dir", help="Output directory of the train-rm stage.")]
RestartOption = Annotated[
    bool,
    typer.Option(
        "--restart",
        help="Delete the output's checkpoints and train from scratch, instead of resuming them "
        "(needed when they were made with other settings or inputs).",
    ),
]


def resolve_config(params: Path, config: list[Path] | None, overrides: list[str] | None) -> Config:
    """Load params.yaml with overlays and overrides; every subcommand starts here."""
    return load_config(params, overlays=config or [], overrides=overrides or [])


def stage_dir(out: Path | None, stage: str) -> Path:
    """Where a stage writes: `--out` if given, else `artifacts/<stage>/`."""
    return out if out is not None else Path("artifacts") / stage
