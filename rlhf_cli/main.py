"""The `rlhf` command: one subcommand per stage, plus config inspection.

Every subcommand takes `--config FILE` (an overlay on params.yaml, repeatable) and `-s key.path=value`
(repeatable), resolves and validates the whole configuration before doing any work, and writes under
`artifacts/<stage>/` unless `--out DIR` says otherwise. Failures exit non-zero with a one-line reason
on stderr; a traceback is shown only with `RLHF_DEBUG=1`.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
import yaml

from rlhf_core.config import Config, ConfigError, load_config

app = typer.Typer(
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,  # main() turns errors into one line
    help=__doc__.splitlines()[0],
)
config_app = typer.Typer(no_args_is_help=True, help="Inspect the resolved configuration.")
app.add_typer(config_app, name="config")

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


def resolve_config(params: Path, config: list[Path] | None, overrides: list[str] | None) -> Config:
    """Load params.yaml with overlays and overrides; every subcommand starts here."""
    return load_config(params, overlays=config or [], overrides=overrides or [])


def stage_dir(out: Path | None, stage: str) -> Path:
    """Where a stage writes: `--out` if given, else `artifacts/<stage>/`."""
    return out if out is not None else Path("artifacts") / stage


@config_app.command("show")
def config_show(
    config: ConfigOption = None,
    set_: SetOption = None,
    params: ParamsOption = Path("params.yaml"),
) -> None:
    """Print the resolved configuration as YAML (PPO preset switches filled in)."""
    resolved = resolve_config(params, config, set_)
    typer.echo(yaml.safe_dump(resolved.model_dump(mode="json"), sort_keys=False), nl=False)


@app.command("prepare-data")
def prepare_data(
    data: Annotated[
        Optional[str], typer.Option("--data", help="A local preference file or a Hub dataset id.")
    ] = None,
    config: ConfigOption = None,
    set_: SetOption = None,
    params: ParamsOption = Path("params.yaml"),
    out: OutOption = None,
) -> None:
    """Validate, split and write the preference data, with a report of what was dropped and why."""
    from rlhf_core.stages.prepare_data import run_prepare_data

    resolved = resolve_config(params, config, set_)
    report = run_prepare_data(resolved, stage_dir(out, "data"), source=data)
    typer.echo(report.summary())


def main() -> None:
    """Console entry point: known errors become one line on stderr and a non-zero exit."""
    try:
        app()  # usage errors are reported by typer itself, with exit status 2
    except Exception as err:  # noqa: BLE001 - the CLI's last line of defence
        if os.environ.get("RLHF_DEBUG"):
            raise
        message = " ".join(str(err).split()) or type(err).__name__
        print(f"rlhf: error: {message}", file=sys.stderr)
        raise SystemExit(1 if not isinstance(err, ConfigError) else 2) from None
