"""The options every `rlhf` subcommand shares, and how they turn into a validated `Config`.

`--config FILE` (repeatable overlay on params.yaml), `-s key.path=value` (repeatable override),
`--params FILE` and `--out DIR`; plus the stage-input directories the training commands take.

Each option is defined once, here, as an annotated type. Typer reads a command's options from its
signature, so every command still lists the ones it takes (`config: ConfigOption = None, ...`): those
parameter lists are alike across the stage commands by design and are the only lines they share; what
the commands do with them is one preamble (`launching.start_training_command`, with which
`run_training_command` starts).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from rlhf_core.config import Config, load_config
from rlhf_core.layout import default_output_dir

# Click's plain help layout rather than Rich's tables: Rich prints a type tag (`<bool>`, `<str>`) beside
# every option, flags and `--help` included; plain help shows each option's metavar below and nothing
# for a flag (tests/cli/test_cli_help.py keeps every help page free of type tags).
HELP_FORMAT = None

ConfigOption = Annotated[
    list[Path] | None,
    typer.Option("--config", "-c", metavar="FILE", help="Overlay YAML merged over params.yaml (repeatable)."),
]
SetOption = Annotated[
    list[str] | None,
    typer.Option("--set", "-s", metavar="KEY=VALUE", help="Override one value: key.path=value (repeatable)."),
]
ParamsOption = Annotated[Path, typer.Option("--params", metavar="FILE", help="The base parameter file.")]
OutOption = Annotated[Path | None, typer.Option("--out", metavar="DIR", help="Output directory of the stage.")]
DataDirOption = Annotated[
    Path, typer.Option("--data-dir", metavar="DIR", help="Prepared data (output of prepare-data).")
]
SftDirOption = Annotated[Path, typer.Option("--sft-dir", metavar="DIR", help="Output directory of the sft stage.")]
RmDirOption = Annotated[Path, typer.Option("--rm-dir", metavar="DIR", help="Output directory of the train-rm stage.")]
RestartOption = Annotated[
    bool,
    typer.Option(
        "--restart",
        help="Delete the output's checkpoints and train from scratch, instead of resuming them "
        "(needed when they were made with other settings or inputs).",
    ),
]
RunsDirOption = Annotated[
    Path, typer.Option("--runs-dir", metavar="DIR", help="Where run directories and the stage cache go.")
]


def resolve_config(params: Path, config: list[Path] | None, overrides: list[str] | None) -> Config:
    """Load params.yaml with overlays and overrides; every subcommand starts here."""
    return load_config(params, overlays=config or [], overrides=overrides or [])


def stage_dir(out: Path | None, stage: str) -> Path:
    """Where a stage writes: `--out` if given, else its directory under `artifacts/` (rlhf_core/layout.py)."""
    return out if out is not None else default_output_dir(stage)
