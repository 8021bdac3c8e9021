"""`rlhf promote` (registered in rlhf_cli/main.py): the `rlhf-promote` flow, here and now.

    rlhf promote                                         # gate the challenger against the champion
    rlhf promote --override --reason "people preferred it in the human evaluation"
    rlhf promote --rollback [--reason "complaints after the release"]

The same flow as the `rlhf-promote` deployment (flows/promote.py), run in this process like `rlhf run`
(a temporary Prefect server when PREFECT_API_URL is unset, the services checked first, other libraries'
messages in a log file: rlhf_cli/in_process.py). The settings are checked by the flow's own rules before
the flow starts: an override without a reason, or with a rollback, is a usage error. It prints the
decision, its reason and each check of the gate, and exits with REFUSED_EXIT_CODE when the answer is a
refusal.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from pydantic import ValidationError

from rlhf_cli.exit_codes import REFUSED_EXIT_CODE
from rlhf_cli.in_process import flow_here
from rlhf_cli.options import ConfigOption, ParamsOption, RunsDirOption, SetOption
from rlhf_core.layout import RUNS_DIR

OverrideOption = Annotated[
    bool, typer.Option("--override", help="Promote the challenger even if it fails the gate (needs --reason).")
]
ReasonOption = Annotated[
    str, typer.Option("--reason", metavar="TEXT", help="Why: required with --override; recorded on the model version.")
]
RollbackOption = Annotated[
    bool, typer.Option("--rollback", help="Move champion back to the version the current champion replaced.")
]


def promote(
    override: OverrideOption = False,
    reason: ReasonOption = "",
    rollback: RollbackOption = False,
    config: ConfigOption = None,
    set_: SetOption = None,
    params: ParamsOption = Path("params.yaml"),
    runs_dir: RunsDirOption = RUNS_DIR,
) -> None:
    """Gate the challenger policy against the champion and promote it, or roll the champion back.

    Exit status:
    0: done (promoted, promoted by override, rolled back, or the challenger already is the champion);
    3: refused (rejected by the gate, or nothing to roll back; the reason is printed);
    1: an error; 2: a usage error.
    """
    with flow_here(params, config, set_, runs_dir) as start:
        # Imported inside: Prefect reads the temporary server's settings when first imported.
        from flows.promote import PromoteSettings, rlhf_promote

        try:
            settings = PromoteSettings(
                mode="rollback" if rollback else "evaluate", override=override, reason=reason, **start.shared_settings
            )
        except ValidationError as error:  # the form's rules (flows/promote.py), before the flow starts
            raise typer.BadParameter(error.errors()[0]["msg"].removeprefix("Value error, ")) from None
        result = rlhf_promote(settings)
        typer.echo(result.summary())
    if result.refused:
        raise typer.Exit(REFUSED_EXIT_CODE)
