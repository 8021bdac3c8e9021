"""The `rlhf.data.pushed` Prefect event: a new version of the raw preference data is in the DVC remote.

`rlhf data add` emits it once `dvc push` has put the new version in the remote, so that new data starts
retraining without anyone pressing Run: the `rlhf-retrain` deployment carries a trigger on this event
(flows/deployments.py, declared again in prefect.yaml) that creates a flow run with the event's data path
and version as its parameters; the retraining checks that the data it pulled is that version
(flows/retrain.py).

The event:
- resource `rlhf.data.<path>` (`prefect.resource.name`: the path), the DVC-tracked directory relative
  to the DVC repository's root, e.g. `rlhf.data.data/raw`;
- payload `path`, `version` (the md5 DVC records in the .dvc file: the data version of the lineage
  tags), `dvc_file` and `remote` (the DVC remote pushed to; null for the default remote).

It is sent only when a Prefect API is configured (PREFECT_API_URL): without one there is no server
whose automations could react, and Prefect would start a temporary server just to drop the event.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

DATA_PUSHED_EVENT = "rlhf.data.pushed"
RESOURCE_PREFIX = "rlhf.data."
EVENT_SEND_TIMEOUT_S = 10.0


def dvc_repo_root(path: Path) -> Path:
    """The nearest directory at or above `path` that holds a `.dvc` directory (the DVC repository)."""
    path = Path(path).resolve()
    for candidate in (path, *path.parents):
        if (candidate / ".dvc").is_dir():
            return candidate
    raise FileNotFoundError(f"{path} is not inside a DVC repository (no .dvc directory above it)")


def data_pushed_payload(target: Path, version: str, remote: str | None) -> dict[str, Any]:
    """The event's payload for the DVC-tracked directory `target` (paths relative to its repository)."""
    relative = Path(target).resolve().relative_to(dvc_repo_root(target)).as_posix()
    return {"path": relative, "version": version, "dvc_file": f"{relative}.dvc", "remote": remote}


def emit_data_pushed(target: Path, version: str, remote: str | None) -> str | None:
    """Send the event to the configured Prefect API and wait until it is out; the API URL, or None when
    no Prefect API is configured (nothing sent)."""
    from prefect.events import emit_event
    from prefect.events.worker import EventsWorker
    from prefect.settings import get_current_settings

    api_url = get_current_settings().api.url
    if not api_url:
        return None
    payload = data_pushed_payload(target, version, remote)
    emit_event(
        event=DATA_PUSHED_EVENT,
        resource={"prefect.resource.id": RESOURCE_PREFIX + payload["path"], "prefect.resource.name": payload["path"]},
        payload=payload,
    )
    # The events worker sends from a background thread; a command that exits right after must wait for it.
    EventsWorker.drain_all(timeout=EVENT_SEND_TIMEOUT_S)
    return api_url
