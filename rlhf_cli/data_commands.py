"""`rlhf data ...`: version the raw preference data with DVC.

`rlhf data status` says in one line where `data/raw` stands (no data in this commit, not pulled,
edited, or a version ready for `dvc repro`) and what to do first.

`rlhf data add FILE` validates a new preference file with the data stage's checks (against the rows
already in `data/raw/`), copies it into `data/raw/`, runs `dvc add data/raw` and `dvc push`, and prints
the new data version (the md5 DVC records in `data/raw.dvc`) with a report of every new row whose prompt
is already an evaluation prompt. A rejected file leaves `data/raw/` and `data/raw.dvc` untouched.
Before any work it checks that the DVC remote it pushes to and the Prefect API answer (tasks/preflight.py).
Once pushed, it emits the Prefect event `rlhf.data.pushed` with the new version (tasks/data/data_events.py)
when a Prefect API is configured: the `rlhf-retrain` deployment's trigger starts a retraining on it.
Registered in rlhf_cli/main.py as `app.add_typer(data_app, name="data")`.

Heavy modules (the tokenizer pulls in torch and transformers) are imported inside the command, so
`rlhf --help` and the other subcommands do not pay for them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from rlhf_cli.library_logs import with_library_log
from rlhf_cli.options import HELP_FORMAT, ConfigOption, ParamsOption, SetOption, resolve_config
from rlhf_core.config import Config
from tasks.data.data_events import DATA_PUSHED_EVENT, emit_data_pushed
from tasks.data.dvc_data import DvcError, dvc_add, dvc_file, dvc_push, raw_data_status, workspace_matches
from tasks.preflight import dvc_remote_services, prefect_api_services
from tasks.services.probes import check_services

if TYPE_CHECKING:
    from rlhf_core.data.versioning import NewFileReport

DEFAULT_RAW_DIR = Path("data/raw")


class RawDataMismatchError(RuntimeError):
    """The raw data on disk is not the version its .dvc file records (not pulled yet, or edited)."""


data_app = typer.Typer(
    no_args_is_help=True, rich_markup_mode=HELP_FORMAT, help="Version the raw preference data with DVC (data/raw)."
)


@dataclass(frozen=True)
class AddResult:
    """A file added to the raw data: the check's report, where it went, and the data version it made."""

    report: NewFileReport
    path: Path
    version: str
    pushed: bool
    remote: str | None  # None: the default remote (core.remote in .dvc/config)
    event_api: str | None = None  # the Prefect API the new-data event went to; None: none sent

    def summary(self) -> str:
        """The report, the new version, and what the user still has to do (commit the .dvc file)."""
        if not self.pushed:
            where = "not pushed (--no-push)"
        elif self.remote is None:
            where = "pushed to the default DVC remote"
        else:
            where = f"pushed to DVC remote {self.remote!r}"
        if self.event_api is not None:
            event = f"sent event {DATA_PUSHED_EVENT} to the Prefect API at {self.event_api} (rlhf-retrain reacts to it)"
        elif self.pushed:
            event = f"no Prefect API configured (PREFECT_API_URL): no {DATA_PUSHED_EVENT} event sent"
        else:
            event = f"no {DATA_PUSHED_EVENT} event: the version is not in a remote yet"
        tracked = dvc_file(self.path.parent)
        return (
            f"{self.report.summary()}\n"
            f"added {self.path}; data version {self.version}, {where}\n"
            f"{event}\n"
            f"commit it: git add {tracked} {tracked.parent / '.gitignore'} && git commit"
        )


def add_preference_file(
    file: Path, config: Config, raw_dir: Path = DEFAULT_RAW_DIR, remote: str | None = None, push: bool = True
) -> AddResult:
    """Validate `file`, merge it into `raw_dir`, `dvc add` and (unless push=False) `dvc push` it.

    The raw data on disk must be the version its .dvc file records: adding to a clone that has not run
    `dvc pull` would otherwise make a new version without the existing rows. Nothing is written when the
    file is rejected, nor while another process adds to `raw_dir` (the output lock,
    rlhf_core/output_lock.py: two merges at once would lose one or make one version of both). If `dvc
    add` fails the copied file is removed again, so the raw data still matches its .dvc file; if only
    the push fails, the new version is complete locally and the error says how to push it. With `push`, the DVC remote
    and the Prefect API are checked before anything else, and a
    pushed version is announced by the `rlhf.data.pushed` event (when a Prefect API is configured).
    """
    from rlhf_core.data.versioning import check_new_file, merge_into_raw
    from rlhf_core.models.base import load_base_tokenizer
    from rlhf_core.output_lock import output_lock
    from rlhf_core.stages.prepare_data import chat_token_lengths

    if push:
        check_services([*dvc_remote_services(nearest_existing(raw_dir), remote), *prefect_api_services()])
    with output_lock(raw_dir, "data add"):  # a second `rlhf data add` on this data fails at once
        tracked = dvc_file(raw_dir)
        if tracked.is_file() and not workspace_matches(raw_dir):
            raise RawDataMismatchError(
                f"{raw_dir} is not the data version {tracked} records: run `dvc pull {tracked}` first "
                f"(or `dvc add {raw_dir}` to make your edits a version), then add the file"
            )
        token_length = chat_token_lengths(load_base_tokenizer(config.model))
        report = check_new_file(file, raw_dir, config.data, token_length)
        merged = merge_into_raw(file, raw_dir)
        try:
            version = dvc_add(raw_dir)
        except DvcError:
            merged.unlink()
            raise
        if push:
            try:
                dvc_push(raw_dir, remote)
            except DvcError as error:
                remote_option = "" if remote is None else f"-r {remote} "
                raise DvcError(
                    f"data version {version} is in the local DVC cache but was not pushed; "
                    f"retry with `dvc push {remote_option}{tracked}`. {error}"
                ) from error
        event_api = emit_data_pushed(raw_dir, version, remote) if push else None
        return AddResult(report=report, path=merged, version=version, pushed=push, remote=remote, event_api=event_api)


def nearest_existing(path: Path) -> Path:
    """`path` or its nearest existing parent: where DVC can be asked about the repository `path` is in."""
    path = Path(path).resolve()
    return next(candidate for candidate in (path, *path.parents) if candidate.exists())


@data_app.command("add")
@with_library_log("data-add")
def add(
    # Described in the docstring, not in an Arguments section: that section would print a type tag.
    file: Annotated[Path, typer.Argument(metavar="FILE", hidden=True)],
    remote: Annotated[
        str | None, typer.Option("--remote", "-r", metavar="NAME", help="DVC remote to push to (default: core.remote).")
    ] = None,
    push: Annotated[bool, typer.Option("--push/--no-push", help="Push the new version to the remote.")] = True,
    config: ConfigOption = None,
    set_: SetOption = None,
    params: ParamsOption = Path("params.yaml"),
    out: Annotated[
        Path | None, typer.Option("--out", metavar="DIR", help="The DVC-tracked raw data directory (default data/raw).")
    ] = None,
) -> None:
    """Validate a preference file, merge it into the raw data, dvc add + push it, print the data version.

    FILE: the new preference file (.jsonl, .jsonl.gz, .json or .parquet; data/README.md).
    """
    resolved = resolve_config(params, config, set_)
    result = add_preference_file(file, resolved, out or DEFAULT_RAW_DIR, remote=remote, push=push)
    typer.echo(result.summary())


@data_app.command("status")
def status() -> None:
    """Say in one line where the raw data (data/raw) stands and what to do first (in a fresh clone:
    `rlhf data add FILE` or `dvc pull data/raw.dvc`)."""
    typer.echo(raw_data_status(DEFAULT_RAW_DIR))
