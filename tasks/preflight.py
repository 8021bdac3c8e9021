"""Preflight: check that every service a command or flow will talk to answers, before any work starts.

Why: the clients of these services retry for minutes before giving up (MLflow's HTTP client took 4.4
minutes and printed five tracebacks for a tracking URI on a closed port), and by then data preparation
and training may have run for nothing. A short HTTP request to each configured service, all at once
with one deadline, turns a wrong URL or a server that is not started into one line, within seconds,
that names the service, its URL and the setting that points there:

    cannot reach the MLflow tracking server at http://127.0.0.1:5399 (set by MLFLOW_TRACKING_URI): connection refused

A service "answers" when it returns any HTTP response below 500: an S3 endpoint refuses an unsigned
request with 403 and a server behind authentication with 401, and both are up. Only services that are
configured are checked: the Prefect API when PREFECT_API_URL is set (otherwise Prefect starts a
temporary server itself), the MLflow tracking server when its URI is http(s) (a SQLite store needs no
server), the S3 endpoint of MLflow's artifact store when MLFLOW_S3_ENDPOINT_URL is set, the S3 store of
remote stages when they are used, and the DVC remote when data is pushed or pulled and the remote is an
S3 endpoint (its `endpointurl`, else AWS_ENDPOINT_URL) or an HTTP server (a local directory remote needs
no server; a cloud store on its default endpoint is not probed).
"""

from __future__ import annotations

import os
from pathlib import Path

from tasks.services.probes import HTTP_SCHEMES, Service

PREFECT_API_URL_ENV = "PREFECT_API_URL"
MLFLOW_S3_ENDPOINT_ENV = "MLFLOW_S3_ENDPOINT_URL"
DVC_S3_ENDPOINT_VARIABLES = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")  # what DVC's S3 client reads


def prefect_api_services() -> list[Service]:
    """The Prefect API, when PREFECT_API_URL is set (in the environment or the active Prefect profile)."""
    from prefect.settings import get_current_settings

    url = get_current_settings().api.url
    if not url:
        return []  # Prefect starts a temporary server of its own
    setting = (
        PREFECT_API_URL_ENV
        if os.environ.get(PREFECT_API_URL_ENV)
        else f"{PREFECT_API_URL_ENV} in the Prefect profile (`prefect config view`)"
    )
    return [Service("Prefect API", url, setting, probe_path="/health")]


def tracking_services(configured_uri: str | None, project_dir: Path) -> list[Service]:
    """The MLflow tracking server (an http(s) tracking URI) and the S3 endpoint of its artifact store."""
    from tasks.tracking.metrics_logger import TRACKING_URI_ENV, resolve_tracking_uri

    services = []
    uri = resolve_tracking_uri(configured_uri, project_dir)
    if uri.startswith(HTTP_SCHEMES):
        setting = TRACKING_URI_ENV if os.environ.get(TRACKING_URI_ENV) else "tracking.tracking_uri"
        services.append(Service("MLflow tracking server", uri, setting, probe_path="/health"))
    if os.environ.get(MLFLOW_S3_ENDPOINT_ENV):
        services.append(Service("S3 artifact store", os.environ[MLFLOW_S3_ENDPOINT_ENV], MLFLOW_S3_ENDPOINT_ENV))
    return services


def stage_store_services(used: bool) -> list[Service]:
    """The S3-compatible endpoint remote stages exchange their files through (remote.store), when used."""
    from tasks.execution.transfer import ENDPOINT_VARIABLES

    if not used:
        return []
    variable = next((name for name in ENDPOINT_VARIABLES if os.environ.get(name)), None)
    return [Service("S3 store of remote.store", os.environ[variable], variable)] if variable else []


def dvc_remote_services(repo_dir: Path, remote: str | None = None) -> list[Service]:
    """The DVC remote `remote` (default: core.remote) of the repository at `repo_dir`, if it is a server."""
    from tasks.data.dvc_data import run_dvc

    settings: dict[str, tuple[str, str]] = {}  # key -> (value, the config file that sets it)
    for line in run_dvc(["config", "--list", "--show-origin"], cwd=Path(repo_dir)).splitlines():
        origin, _, assignment = line.partition("\t")
        key, _, value = assignment.partition("=")
        settings[key.strip()] = (value.strip(), origin.strip())
    name = remote or settings.get("core.remote", ("", ""))[0]
    for key, label in ((f"remote.{name}.endpointurl", "S3 endpoint"), (f"remote.{name}.url", "server")):
        value, origin = settings.get(key, ("", ""))
        if value.startswith(HTTP_SCHEMES):
            return [Service(f"DVC remote {name!r} ({label})", value, f"{key} in {origin}")]
    if settings.get(f"remote.{name}.url", ("", ""))[0].startswith("s3://"):  # the endpoint from the environment
        variable = next((env for env in DVC_S3_ENDPOINT_VARIABLES if os.environ.get(env)), None)
        if variable is not None:
            return [Service(f"DVC remote {name!r} (S3 endpoint)", os.environ[variable], variable)]
    return []
