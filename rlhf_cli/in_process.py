"""What `rlhf run`, `rlhf ablate` and `rlhf promote` do around a flow they run in this process.

`flow_here` is their shared start: the config resolved first (a bad key fails before any service is
asked), then the flow's surroundings below, and the settings every flow's form takes from the shared
options (`--config`, `-s`, `--params`, `--runs-dir`).

They run their flow here and now rather than through a deployment: with PREFECT_API_URL unset,
Prefect starts a temporary server of its own, which inherits this process's environment and reads its
settings when Prefect is first imported (inside the command). `in_process_flow` therefore, in order:
1. sets TEMPORARY_SERVER_SETTINGS (each unless the user set it);
2. checks every service the flow will use (tasks/preflight.py), so an unreachable one fails in seconds;
3. imports Prefect, whose console handler the next step must find, and
4. sends other libraries' warnings and notices to a log file under the runs directory, their progress
   bars off when stderr is not a terminal (rlhf_cli/library_logs.py), so a flow that works prints its
   progress and its summary only, and then the log file's name.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from rlhf_cli.library_logs import library_log, run_log_path
from rlhf_cli.options import resolve_config
from rlhf_core.config import Config

# For the temporary Prefect server:
# - its telemetry heartbeat fails offline ("Failed to send telemetry") and races the run for its SQLite
#   database ("database is locked", with a traceback): off, and the client's too (DO_NOT_TRACK), which
#   would otherwise print Prefect's anonymous-usage notice on a first run;
# - it gets 20 s to start by default, which a busy 2-core machine overran: 120 s.
# (It cannot hold the machine's training slot either: tasks/concurrency.py says why, and what does.)
TEMPORARY_SERVER_SETTINGS = {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "DO_NOT_TRACK": "1",
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
}


def use_temporary_server_settings() -> None:
    """Set each of TEMPORARY_SERVER_SETTINGS in this process's environment, unless it is set already."""
    for name, value in TEMPORARY_SERVER_SETTINGS.items():
        os.environ.setdefault(name, value)


@contextmanager
def in_process_flow(runs_dir: Path, tracking_uri: str | None) -> Iterator[Path]:
    """Prepare, check and quieten a flow run in this process (module docstring); yields the log file's path.

    The block should print its summary inside the `with`, so that the log file's line comes after it.

    `tracking_uri` is the resolved config's tracking.tracking_uri (None: MLFLOW_TRACKING_URI or the
    working directory's default store).
    """
    use_temporary_server_settings()
    from tasks.preflight import check_services, prefect_api_services, tracking_services

    check_services([*prefect_api_services(), *tracking_services(tracking_uri, Path.cwd())])
    import prefect  # noqa: F401 - configures the root logger's console handler on import

    with library_log(run_log_path(runs_dir)) as log_path:
        yield log_path


@dataclass(frozen=True)
class FlowStart:
    """What a command that runs a flow here has once `flow_here` has started it."""

    config: Config  # the resolved configuration
    shared_settings: dict[str, object]  # the flow settings' `config`, `overrides`, `params_file`, `runs_dir`


@contextmanager
def flow_here(
    params: Path, config: list[Path] | None, overrides: list[str] | None, runs_dir: Path
) -> Iterator[FlowStart]:
    """Resolve the config (a bad key fails here, before any service is asked), then `in_process_flow`."""
    resolved = resolve_config(params, config, overrides)
    with in_process_flow(runs_dir, resolved.tracking.tracking_uri):
        yield FlowStart(
            config=resolved,
            shared_settings={
                "config": [str(path) for path in config or []],
                "overrides": list(overrides or []),
                "params_file": str(params),
                "runs_dir": str(runs_dir),
            },
        )
