"""`rlhf ablate` (registered in rlhf_cli/main.py): the `rlhf-ablation` flow, here and now.

    rlhf ablate --grid configs/ablations/paper.yaml --base runs/20261201-101500-1a2b3c4d

`--base` names a pipeline run (its directory, its MLflow run id, or a registered policy's `models:/`
URI); `--data/--sft/--reward/--judge` name single inputs instead. `--config`/`-s` shape the base
configuration every variant starts from (scale, steps, learning rates); each variant then sets its
preset and `ppo.*` overrides (docs/ablation.md). Every variant is validated before Prefect starts: a
bad key exits with status 2 naming the variant and the key; so is the base (no `--base` and an input
missing, a `--base` that cannot name a run, an input directory that is not a complete stage output), in
one line. Like `rlhf run`, the flow runs in this process (a temporary Prefect server when
PREFECT_API_URL is unset, checked services and other libraries' messages in a log file:
rlhf_cli/in_process.py) and tracks to MLflow; the command ends by printing where the comparison is.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from rlhf_cli.in_process import flow_here
from rlhf_cli.options import ConfigOption, ParamsOption, RunsDirOption, SetOption
from rlhf_core.layout import RUNS_DIR

GridOption = Annotated[
    Path, typer.Option("--grid", metavar="FILE", help="The grid file: named variants (configs/ablations/*.yaml).")
]
BaseOption = Annotated[
    str | None,
    typer.Option(
        "--base",
        metavar="RUN",
        help="A pipeline run: its directory (runs/<id>), MLflow run id, or a policy's models:/ URI.",
    ),
]
VariantOption = Annotated[
    list[str] | None, typer.Option("--variant", metavar="NAME", help="Run only this variant of the grid (repeatable).")
]
InputOption = Annotated[
    str | None, typer.Option(metavar="DIR", help="This input instead of the base's (a stage output directory).")
]
JudgeOption = Annotated[
    str | None,
    typer.Option(
        "--judge", metavar="MODEL", help="Judge reward model instead of the base's (directory or models:/ URI)."
    ),
]
RemoteStoreOption = Annotated[
    str | None,
    typer.Option(
        "--remote-store",
        metavar="S3_PREFIX",
        help="Run the variants on the GPU pool (rlhf-stage deployment), files via this s3:// prefix.",
    ),
]


def ablate(
    grid: GridOption,
    base: BaseOption = None,
    variant: VariantOption = None,
    data: InputOption = None,
    sft: InputOption = None,
    reward: InputOption = None,
    judge: JudgeOption = None,
    config: ConfigOption = None,
    set_: SetOption = None,
    params: ParamsOption = Path("params.yaml"),
    runs_dir: RunsDirOption = RUNS_DIR,
    remote_store: RemoteStoreOption = None,
) -> None:
    """Run PPO once per variant of a grid on one base, evaluate each against SFT, and compare them."""
    with flow_here(params, config, set_, runs_dir) as start:
        # Imported inside: importing the flows already makes libraries warn.
        from flows.ablation import AblationSettings, rlhf_ablation
        from tasks.stages.remote import RemoteStages

        settings = AblationSettings(
            **start.shared_settings,
            grid=str(grid),
            only=list(variant or []),
            base=base,
            data=data,
            sft=sft,
            reward=reward,
            judge=judge,
            remote=RemoteStages(stages=["ppo"], store=remote_store) if remote_store else RemoteStages(),
        )
        plan = settings.plan()  # every variant validated before Prefect starts
        settings.reference().check()  # and the base's inputs named (rather than failing inside the flow)
        typer.echo(f"ablation {plan.grid.name}: {', '.join(item.name for item in plan.variants)}")
        typer.echo(rlhf_ablation(settings).summary())
