"""One training stage per machine at a time, through a Prefect global concurrency limit.

Two pipeline runs on one machine (a scheduled retrain and a manual run, say) would otherwise train
side by side, each at half speed and with twice the memory. Each training stage holds a slot of the
limit `rlhf-training-<hostname>` while it trains; a second training stage waits for the slot. A
cached stage does not train and takes no slot.

The limit is created with TRAINING_SLOTS slots the first time it is needed. An existing limit is left
as it is, so that an operator can raise it (a machine with several GPUs) in the UI or with
`prefect gcl update rlhf-training-<hostname> --limit N`.

A slot is a lease that the holding process renews while it trains. A process that is killed cannot
release its slot; the Prefect server takes it back once the lease runs out, LEASE_SECONDS (5 minutes;
the environment variable RLHF_TRAINING_LEASE_SECONDS changes it, 60 at least) after the last renewal.
So a pipeline rerun straight after a kill waits up to that long before it trains.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Iterator
from contextlib import contextmanager

from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
from prefect.concurrency.sync import concurrency
from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

TRAINING_SLOTS = 1
LIMIT_PREFIX = "rlhf-training"
LEASE_SECONDS = 300.0
LEASE_ENV = "RLHF_TRAINING_LEASE_SECONDS"


def training_limit_name(hostname: str | None = None) -> str:
    """`rlhf-training-<hostname>`, the host name reduced to the characters a limit name may hold."""
    host = (hostname or socket.gethostname()).lower()
    return f"{LIMIT_PREFIX}-{re.sub(r'[^a-z0-9.-]+', '-', host)}"


def ensure_training_limit(name: str, slots: int = TRAINING_SLOTS) -> None:
    """Create the global concurrency limit `name` with `slots` slots unless it exists already."""
    with get_client(sync_client=True) as client:
        try:
            client.read_global_concurrency_limit_by_name(name)
            return
        except ObjectNotFound:
            pass
        try:
            client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=slots))
        except ObjectAlreadyExists:
            pass  # another run created it between our read and create


@contextmanager
def training_slot(name: str | None = None) -> Iterator[None]:
    """Hold one slot of this machine's training limit for the duration of the block."""
    limit = name or training_limit_name()
    ensure_training_limit(limit)
    with concurrency(limit, occupy=1, strict=True, lease_duration=lease_seconds()):
        yield


def lease_seconds() -> float:
    """How long a killed holder keeps its slot: RLHF_TRAINING_LEASE_SECONDS, else LEASE_SECONDS."""
    return float(os.environ.get(LEASE_ENV, LEASE_SECONDS))
