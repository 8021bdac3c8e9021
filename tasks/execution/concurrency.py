"""One training stage per machine at a time: a Prefect global concurrency limit, or a file lock.

Two pipeline runs on one machine (a scheduled retrain and a manual run, say) would otherwise train
side by side, each at half speed and with twice the memory. Each training stage holds a slot while it
trains; a second training stage waits for it. A cached stage does not train and takes no slot.

With a Prefect server (PREFECT_API_URL set, as under `rlhf serve` and on workers) the slot is one of
the global concurrency limit `rlhf-training-<hostname>`, created with TRAINING_SLOTS slots the first
time it is needed. An existing limit is left as it is, so that an operator can raise it (a machine
with several GPUs) in the UI or with `prefect gcl update rlhf-training-<hostname> --limit N`. A slot is
a lease that the holding process renews while it trains. A process that is killed cannot release its
slot; the server takes it back once the lease runs out, LEASE_SECONDS (5 minutes; the environment
variable RLHF_TRAINING_LEASE_SECONDS changes it, 60 at least) after the last renewal.

Without one (`rlhf run` and `rlhf ablate` on Prefect's temporary server) the slot is the exclusive
file lock of rlhf_core/file_lock.py on `<PREFECT_HOME>/<limit name>.lock`, whose record names the
stage holding it (pid, host, start time) to the stage that waits. The temporary server cannot hold the slot: it does not
run Prefect's lease reaper (the repossessor is not among the services of an ephemeral server), so the
slot of a run killed while it trained stayed taken in PREFECT_HOME's database for good and every later
run waited forever. The kernel releases a `flock` when its holder dies, however it dies. The same goes for
a server that keeps its leases in memory (Prefect's default lease storage): a restart of it forgets the
lease of a stage that is training, and the slot stayed taken for good (docs/service-outages.md); with such
a server the slot is the file lock too, and `rlhf run` and `rlhf serve` say so in a warning.

Within one pipeline run, stages that train at once (the judge reward model beside SFT and the reward
model, flows/pipeline.py) split the machine's cores between them and count as one training stage: the run
opens a `SharedSlot` for them (`shared_training_slot`), the first of them to train takes the slot, the
others join it, and the run gives it back when they are all done. Cached stages take nothing, as before.
"""

from __future__ import annotations

import os
import re
import socket
import threading
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from contextvars import ContextVar
from pathlib import Path

from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
from prefect.concurrency.sync import concurrency
from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound
from prefect.logging import get_logger
from prefect.settings import get_current_settings

from rlhf_core.file_lock import LockTakenError, acquire_lock
from tasks.services.service_outages import MEMORY_LEASE_STORAGE, server_lease_storage

TRAINING_SLOTS = 1
LIMIT_PREFIX = "rlhf-training"
LEASE_SECONDS = 300.0
LEASE_ENV = "RLHF_TRAINING_LEASE_SECONDS"

logger = get_logger(__name__)


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


class SharedSlot:
    """One training slot for the stages of one run that train at once: taken by the first of them that
    trains (`hold`), kept until `release`; a stage waiting for it makes the others wait too."""

    def __init__(self, name: str | None = None) -> None:
        self.name = name
        self.lock = threading.Lock()
        self.held = ExitStack()
        self.taken = False

    def hold(self, stage: str) -> None:
        """Take the slot for `stage` unless this run holds it already (waiting for it like any training stage)."""
        with self.lock:
            if not self.taken:
                self.held.enter_context(exclusive_training_slot(stage, self.name))
                self.taken = True

    def release(self) -> None:
        """Give the slot back, if it was taken."""
        with self.lock:
            self.held.close()
            self.taken = False


# The run's shared slot, while stages of it train at once (threads started with a copy of the context see it).
SHARED_SLOT: ContextVar[SharedSlot | None] = ContextVar("rlhf_shared_training_slot", default=None)


@contextmanager
def shared_training_slot(name: str | None = None) -> Iterator[SharedSlot]:
    """Within the block, `training_slot` takes or joins one `SharedSlot`, given back when the block ends."""
    shared = SharedSlot(name)
    token = SHARED_SLOT.set(shared)
    try:
        yield shared
    finally:
        SHARED_SLOT.reset(token)
        shared.release()


@contextmanager
def training_slot(stage: str, name: str | None = None) -> Iterator[None]:
    """Hold one slot of this machine's training limit for `stage` for the duration of the block (module
    docstring), or, inside `shared_training_slot`, the run's shared one (held until that block ends)."""
    shared = SHARED_SLOT.get()
    if shared is not None:
        shared.hold(stage)
        yield
        return
    with exclusive_training_slot(stage, name):
        yield


@contextmanager
def exclusive_training_slot(stage: str, name: str | None = None) -> Iterator[None]:
    """One slot of this machine's training limit, this block's alone, held for `stage`."""
    limit = name or training_limit_name()
    api_url = get_current_settings().api.url
    if api_url is None or server_lease_storage(api_url) == MEMORY_LEASE_STORAGE:  # see the module docstring
        with training_lock(Path(get_current_settings().home) / f"{limit}.lock", stage):
            yield
        return
    ensure_training_limit(limit)
    with concurrency(limit, occupy=1, strict=True, lease_duration=lease_seconds()):
        yield


@contextmanager
def training_lock(path: Path, stage: str) -> Iterator[None]:
    """The file lock on `path` for `stage` for the block; says whom it waits for when another process holds it."""
    try:
        lock = acquire_lock(path, stage)
    except LockTakenError as taken:
        holder = taken.holder.describe() if taken.holder is not None else "another process"
        logger.info("waiting for this machine's training slot, held by %s (%s)", holder, path)
        lock = acquire_lock(path, stage, wait=True)
    with lock:
        yield


def lease_seconds() -> float:
    """How long a killed holder keeps its slot: RLHF_TRAINING_LEASE_SECONDS, else LEASE_SECONDS."""
    return float(os.environ.get(LEASE_ENV, LEASE_SECONDS))
