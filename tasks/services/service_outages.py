"""A tracking server or Prefect API that stops answering in the middle of a run: wait, else stop in one line.

Both clients already wait for their server, with bounded retries and exponential backoff:
- MLflow's HTTP client retries a refused or broken connection MLFLOW_HTTP_REQUEST_MAX_RETRIES times
  (default 7, backoff factor MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR 2: about 4 minutes) before it raises;
- Prefect's client retries a refused connection, to a server it has reached before, PREFECT_CLIENT_MAX_RETRIES
  times (Prefect's default 5 is about 1 minute, which a minute-long outage used up; `rlhf run`
  makes it 7, about 4 minutes like MLflow's, unless the variable is set: `CLIENT_RETRY_SETTINGS`).
So a server that comes back within those minutes costs the run that wait and nothing else: the stage goes on
where it was (tests/orchestration/test_service_outages.py stops each server mid-stage and starts it again).

A server that stays away longer fails the stage with the client's error. Retrying the stage would only wait the
same minutes again (and an attempt that cannot reach MLflow cannot even open its run), so such a failure is not
retried (tasks/execution/retries.py), and no failed MLflow run (of that stage, of a stage stopped beside it, of the
pipeline) is closed on a tracking server that is gone (tasks/tracking/mlflow_runs.py): that would wait the minutes once
more, to fail; the run stays RUNNING there until the next pipeline run closes it (tasks/tracking/run_owner.py). The
command then ends with `lost_service_line`, one line naming the service and its URL. The interrupted stage has
no metrics.json (it is incomplete by the project's rule) and the same command run again reuses the finished
stages and resumes that one from its newest checkpoint (tasks/stages/resume.py).
"""

from __future__ import annotations

import json
import os
import re
import sys
import urllib.request
from collections.abc import Iterable

from rlhf_core.write_failures import error_chain

CLIENT_RETRY_SETTINGS = {"PREFECT_CLIENT_MAX_RETRIES": "7"}  # sleeps 2+4+...+128 s: about 4 minutes
MLFLOW_REQUEST_URL = re.compile(r"API request to (\S+?)/api/")
CLIENT_MODULES = ("mlflow.", "requests.", "httpx")  # where the errors of a client that gave up come from
MEMORY_LEASE_STORAGE = "prefect.server.concurrency.lease_storage.memory"  # Prefect's default
FILE_LEASE_STORAGE = "prefect.server.concurrency.lease_storage.filesystem"
SETTINGS_TIMEOUT_S = 3.0
RESUME_ADVICE = "rerun the same command once it answers: finished stages are reused and the interrupted one resumes"


def use_client_retry_settings() -> None:
    """Set each of CLIENT_RETRY_SETTINGS in this process's environment unless it is set (before Prefect is imported)."""
    for name, value in CLIENT_RETRY_SETTINGS.items():
        os.environ.setdefault(name, value)


def lost_tracking_server(error: BaseException) -> str | None:
    """The tracking server's URL when `error` is MLflow's client giving up on reaching it, else None."""
    import requests
    from mlflow.exceptions import MlflowException

    for link in error_chain(error):
        if isinstance(link, MlflowException):
            found = MLFLOW_REQUEST_URL.search(link.message)
            unreachable = any(
                isinstance(cause, (requests.exceptions.ConnectionError, requests.exceptions.Timeout))
                for cause in error_chain(link)
            )
            if found and unreachable:
                return found.group(1)
    return None


def tracking_server_gone(tracking_uri: str) -> bool:
    """True when `tracking_uri` is a server that does not answer its health check now (a few seconds): closing a
    failed run there would wait the client's minutes, to fail. A local store (SQLite) is never gone."""
    from tasks.services.probes import HTTP_SCHEMES, PROBE_TIMEOUT_S, Service, probe

    if not tracking_uri.startswith(HTTP_SCHEMES):
        return False
    return probe(Service("MLflow tracking server", tracking_uri, "", probe_path="/health"), PROBE_TIMEOUT_S) is not None


def lost_prefect_api(error: BaseException) -> str | None:
    """The Prefect API's URL when `error` is a transport error (no connection, a broken one) of a request to it,
    else None: a request elsewhere (the Hugging Face Hub, an LLM judge) is not the Prefect API."""
    import httpx
    from prefect.settings import get_current_settings

    configured = get_current_settings().api.url
    for link in error_chain(error):
        if isinstance(link, httpx.TransportError):
            try:
                url = str(link.request.url)
            except RuntimeError:  # an error raised without its request
                continue
            api_url = configured.rstrip("/") if configured else url.split("/api/")[0] + "/api"
            if url.startswith(api_url + "/"):
                return api_url
    return None


def lost_service_line(error: BaseException) -> str | None:
    """The one line a command ends with when a service stopped answering mid-run; None for any other error
    (decided without importing MLflow or Prefect when no error in the chain comes from their clients)."""
    if not any(type(link).__module__.startswith(CLIENT_MODULES) for link in error_chain(error)):
        return None
    url = lost_tracking_server(error)
    if url is not None:
        return f"lost the MLflow tracking server at {url}: it stopped answering during the run; {RESUME_ADVICE}"
    url = lost_prefect_api(error)
    if url is not None:
        return f"lost the Prefect API at {url}: it stopped answering during the run; {RESUME_ADVICE}"
    return None


def server_lease_storage(api_url: str) -> str | None:
    """Where the Prefect server at `api_url` keeps concurrency leases (its lease storage module); None when it
    does not say (an older server, one behind authentication, one that does not answer within seconds)."""
    try:
        with urllib.request.urlopen(f"{api_url.rstrip('/')}/admin/settings", timeout=SETTINGS_TIMEOUT_S) as response:
            return str(json.load(response)["server"]["concurrency"]["lease_storage"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def memory_leases_warning(api_url: str) -> str | None:
    """A warning when the Prefect server at `api_url` keeps concurrency leases in memory (Prefect's default);
    None when it keeps them elsewhere or does not say.

    A restart of such a server forgets the lease of the training slot a running stage holds, and the slot
    would stay taken for good: with such a server the training slot is this machine's file lock instead
    (tasks/execution/concurrency.py), which the Prefect UI does not show (docs/service-outages.md).
    """
    if server_lease_storage(api_url) != MEMORY_LEASE_STORAGE:
        return None
    return (
        f"the Prefect server at {api_url} keeps concurrency leases in memory, which a restart forgets: the "
        f"training slot is this machine's file lock instead of its global concurrency limit; start the server with "
        f"PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE={FILE_LEASE_STORAGE}"
    )


def warn_about_memory_leases(api_urls: Iterable[str]) -> None:
    """Print `memory_leases_warning` of each Prefect API in `api_urls` that has one, as a line on stderr."""
    for api_url in api_urls:
        warning = memory_leases_warning(api_url)
        if warning is not None:
            print(f"rlhf: warning: {warning}", file=sys.stderr, flush=True)
