"""`rlhf run` (the whole pipeline, here and now) and `rlhf serve` (the deployments, for the Prefect UI).

Registered in rlhf_cli/main.py. `rlhf run` runs the `rlhf-pipeline` flow in this process on the
embedded defaults: with PREFECT_API_URL unset Prefect starts a temporary server for the run itself,
MLflow tracks to `mlflow.db` + `mlruns/` in the working directory unless MLFLOW_TRACKING_URI (or
tracking.tracking_uri) says otherwise, and each run writes under `runs/<created>-<id>/`. It ends by
printing where the results are: run directory, data version, MLflow run, evaluation, registered versions.
Before any work both commands check the services they will use (tasks/preflight.py) and stop within
seconds, in one line, when one does not answer (and `rlhf run` that a local `--data` exists);
`rlhf run` also sets up the temporary server and sends other libraries' warnings and notices to
`runs/logs/rlhf-run-*.log` (rlhf_cli/in_process.py), so a run that works prints its progress, a line
per stage and the summary.

`rlhf serve` serves the deployments of flows/deployments.py (pipeline, retrain, promote, human-eval)
against the configured Prefect server (`prefect config set PREFECT_API_URL=...`, or a started
`prefect server start`), until interrupted: it stops within 5 s of SIGINT or SIGTERM, also when that
server is gone (flows/serving.py). Its flow runs write to its log, never to a terminal, so it switches the
libraries' progress bars and notices off for them (rlhf_cli/quiet_libraries.py).

Flows (and with them Prefect, MLflow and torch) are imported inside the commands, so
`rlhf --help` stays fast.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from rlhf_cli.in_process import flow_here
from rlhf_cli.options import ConfigOption, ParamsOption, RunsDirOption, SetOption
from rlhf_cli.quiet_libraries import silence_libraries
from rlhf_core.layout import RUNS_DIR

DataOption = Annotated[
    str | None,
    typer.Option(
        "--data",
        metavar="SOURCE",
        help="A local preference file or directory, or a Hub dataset id (default: data.source).",
    ),
]
StageOption = Annotated[
    list[str] | None,
    typer.Option(
        "--stage",
        metavar="STAGE",
        help="Run only this stage and those it needs (repeatable): prepare-data, sft, reward, judge-reward, ppo, "
        "evaluate, register.",
    ),
]
LimitOption = Annotated[
    int | None, typer.Option("--limit", metavar="N", help="Most flow runs this process runs at once (default: no cap).")
]


def run(
    data: DataOption = None,
    config: ConfigOption = None,
    set_: SetOption = None,
    params: ParamsOption = Path("params.yaml"),
    runs_dir: RunsDirOption = RUNS_DIR,
    stage: StageOption = None,
) -> None:
    """Run the whole pipeline (prepare data, SFT, reward model, PPO-max, evaluate, register) and say where it all is."""
    with flow_here(params, config, set_, runs_dir) as start:
        # Imported inside: importing the flows already makes libraries warn.
        from flows.pipeline import PipelineSettings, Stage, rlhf_pipeline
        from rlhf_core.stages.prepare_data import resolve_sources

        resolve_sources(
            data or start.config.data.source, start.config
        )  # a missing local input: one line, before Prefect
        settings = PipelineSettings(
            **start.shared_settings, data=data, stages=[Stage(name) for name in stage] if stage else list(Stage)
        )
        typer.echo(rlhf_pipeline(settings).summary())


def serve(limit: LimitOption = None) -> None:
    """Serve every deployment of flows/deployments.py from this machine (run them from the Prefect UI)."""
    silence_libraries()  # before the flows import transformers; the flow-run processes inherit the switches
    from flows.serving import serve_deployments
    from tasks.preflight import prefect_api_services, tracking_services
    from tasks.services.probes import check_services
    from tasks.services.service_outages import warn_about_memory_leases

    prefect_apis = prefect_api_services()
    check_services([*prefect_apis, *tracking_services(None, Path.cwd())])
    warn_about_memory_leases(service.url for service in prefect_apis)
    serve_deployments(limit=limit)
