"""The `rlhf` command: one subcommand per stage, plus config inspection.

Every command that reads the configuration takes `--config FILE` (an overlay on params.yaml,
repeatable), `-s key.path=value` (repeatable) and `--params FILE`, and resolves and validates the whole
configuration before doing any work; stage commands write under `artifacts/<stage>/` unless `--out DIR`
says otherwise (README.md, "Configuration", lists each command's options; tests/cli/test_cli_help.py keeps
that list equal to `--help`). Failures exit non-zero with a one-line reason on stderr (a full or
read-only file system: "cannot write <path>: no space left on device"; a pipeline stage's failure also
names the stage, and the log file that holds the traceback); a traceback is shown on the terminal only
with `RLHF_DEBUG=1`. Other libraries' warnings go to a log file that the command names after its
summary, and their progress bars are off when stderr is not a terminal or RLHF_QUIET is set
(rlhf_cli/library_logs.py: `with_library_log` for the stage commands, `rlhf run` and `rlhf ablate`
through rlhf_cli/in_process.py).
"""

from __future__ import annotations

import errno
import os
import sys
from pathlib import Path
from typing import Annotated

import typer
import yaml

from flows.failed_stage import failed_stage
from rlhf_cli import ppo_command, run_commands, stage_commands
from rlhf_cli.ablate_command import ablate
from rlhf_cli.data_commands import data_app
from rlhf_cli.eval_command import eval_command
from rlhf_cli.library_logs import traceback_log, with_library_log
from rlhf_cli.options import HELP_FORMAT, ConfigOption, OutOption, ParamsOption, SetOption, resolve_config, stage_dir
from rlhf_cli.promote_command import promote
from rlhf_core.config import ConfigError
from rlhf_core.write_failures import OutputWriteError

WRITE_ONLY_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)  # a refused read says EACCES, never these

app = typer.Typer(
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,  # main() turns errors into one line
    rich_markup_mode=HELP_FORMAT,
    help=__doc__.splitlines()[0],
)
config_app = typer.Typer(no_args_is_help=True, rich_markup_mode=HELP_FORMAT, help="Inspect the resolved configuration.")
app.add_typer(config_app, name="config")


@config_app.command("show")
def config_show(
    config: ConfigOption = None, set_: SetOption = None, params: ParamsOption = Path("params.yaml")
) -> None:
    """Print the resolved configuration as YAML (PPO preset switches filled in)."""
    resolved = resolve_config(params, config, set_)
    typer.echo(yaml.safe_dump(resolved.model_dump(mode="json"), sort_keys=False), nl=False)


@app.command("prepare-data")
@with_library_log("prepare-data")
def prepare_data(
    data: Annotated[
        str | None,
        typer.Option("--data", metavar="SOURCE", help="A local preference file or directory, or a Hub dataset id."),
    ] = None,
    config: ConfigOption = None,
    set_: SetOption = None,
    params: ParamsOption = Path("params.yaml"),
    out: OutOption = None,
) -> None:
    """Validate, split and write the preference data, with a report of what was dropped and why."""
    from rlhf_core.stages.prepare_data import run_prepare_data

    resolved = resolve_config(params, config, set_)
    report = run_prepare_data(resolved, stage_dir(out, "prepare-data"), source=data)
    typer.echo(report.summary())


app.command("sft")(with_library_log("sft")(stage_commands.sft))
app.command("train-rm")(with_library_log("train-rm")(stage_commands.train_rm))
app.command("judge-rm")(with_library_log("judge-rm")(stage_commands.judge_rm))
app.command("score-pairs")(with_library_log("score-pairs")(stage_commands.score_pairs))
app.command("ppo")(with_library_log("ppo")(ppo_command.ppo))
app.command("eval")(with_library_log("eval")(eval_command))
app.command("run")(run_commands.run)
app.command("serve")(run_commands.serve)
app.command("ablate")(ablate)
app.command("promote")(promote)
app.add_typer(data_app, name="data")


def main() -> None:
    """Console entry point: known errors become one line on stderr and a non-zero exit."""
    try:
        app()  # usage errors are reported by typer itself, with exit status 2
    except Exception as err:  # noqa: BLE001 - the CLI's last line of defence
        if os.environ.get("RLHF_DEBUG"):
            raise
        message = " ".join(error_line(err).split()) or type(err).__name__
        print(f"rlhf: error: {message}", file=sys.stderr)
        raise SystemExit(1 if not isinstance(err, ConfigError) else 2) from None


def error_line(err: Exception) -> str:
    """What the one error line says: the error, after the pipeline stage it failed (flows/failed_stage.py)
    and before the log file that holds its traceback (rlhf_cli/library_logs.py), where there are such."""
    line = error_text(err)
    stage = failed_stage(err)
    if stage is not None:
        line = f"stage {stage} failed: {line}"
    log = traceback_log(err)
    return line if log is None else f"{line} (traceback in {log})"


def error_text(err: Exception) -> str:
    """The error in words: a write a full or read-only file system refused, outside any stage's output (a
    log file, a cache), as "cannot write <path>: <reason>", like a stage's (rlhf_core/write_failures.py);
    a tracking server or Prefect API that stopped answering mid-run by its name and URL
    (tasks/services/service_outages.py); anything else as the error says."""
    from tasks.services.service_outages import lost_service_line

    lost = lost_service_line(err)
    if lost is not None:
        return lost
    if isinstance(err, OSError) and err.errno in WRITE_ONLY_ERRNOS and err.filename:
        return str(OutputWriteError(err.filename, err.errno))
    return str(err)
