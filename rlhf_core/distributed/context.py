"""Which rank this process is, read from the environment the `deepspeed` launcher sets.

The launcher exports `RANK` (global rank), `WORLD_SIZE` and `LOCAL_RANK` (rank on this node; the GPU
index) to every process it starts, plus `MASTER_ADDR`/`MASTER_PORT` for the rendezvous. A process
started any other way has none of them and is rank 0 of a world of 1: the single-process default,
which never initialises `torch.distributed` (nor imports deepspeed).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import torch

from rlhf_core.config import DistributedConfig


class RankEnvironmentError(RuntimeError):
    """The launcher's rank variables are missing, malformed or inconsistent."""


@dataclass(frozen=True)
class RankContext:
    """This process's place among the ranks of a launched stage."""

    rank: int
    world_size: int
    local_rank: int

    @property
    def is_main(self) -> bool:
        """Rank 0: the one rank that logs, checkpoints and writes the stage's outputs."""
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        """Whether there are other ranks to talk to (a process group is needed)."""
        return self.world_size > 1


SINGLE_PROCESS = RankContext(rank=0, world_size=1, local_rank=0)


def _read_int(environ: Mapping[str, str], name: str, default: int) -> int:
    raw = environ.get(name)
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError:
        raise RankEnvironmentError(f"environment variable {name}={raw!r} is not an integer") from None


def rank_context(environ: Mapping[str, str] | None = None) -> RankContext:
    """The rank context of this process (`environ` defaults to `os.environ`); a world of 1 without them."""
    environ = os.environ if environ is None else environ
    world_size = _read_int(environ, "WORLD_SIZE", 1)
    rank = _read_int(environ, "RANK", 0)
    local_rank = _read_int(environ, "LOCAL_RANK", rank)
    if world_size < 1 or not 0 <= rank < world_size or local_rank < 0:
        raise RankEnvironmentError(
            f"inconsistent launcher environment: RANK={rank}, WORLD_SIZE={world_size}, LOCAL_RANK={local_rank}"
        )
    return RankContext(rank=rank, world_size=world_size, local_rank=local_rank)


def init_process_group(context: RankContext) -> None:
    """Join the ranks' process group once (NCCL on CUDA, gloo on CPU); a no-op for a world of 1.

    Goes through `deepspeed.init_distributed`, so DeepSpeed's communication layer and plain
    `torch.distributed` share one group. On CUDA it first pins this process to GPU `local_rank`, so
    that `torch.device("cuda")` (what the stages use) is this rank's own GPU.
    """
    if not context.is_distributed or torch.distributed.is_initialized():
        return
    if torch.cuda.is_available():
        torch.cuda.set_device(context.local_rank)
    import deepspeed  # imported here: a 10-20 s import that single-process runs never pay
    from deepspeed.accelerator import get_accelerator

    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    if torch.distributed.get_world_size() != context.world_size:
        raise RankEnvironmentError(
            f"the process group has {torch.distributed.get_world_size()} ranks, WORLD_SIZE says {context.world_size}"
        )
    torch.distributed.barrier()  # every rank has mapped every other rank's buffer by now
    shared_allreduce_buffer(context.rank).unlink(missing_ok=True)


def leave_process_group() -> None:
    """Leave the ranks' process group together: a barrier, then destroy it (a no-op when none was joined).

    Called by a rank that has finished its work, before the process exits. A rank that exits with its group
    still alive can abort on the way out ("terminate called without an active exception", SIGABRT, after its
    last line) while its peer closes their connections: 3 of 4 two-rank launches of a plain group did so
    under load, none of 8 with this call (infra/deepspeed/README.md). A failing rank exits without it: the
    launcher kills its peers.
    """
    if not torch.distributed.is_initialized():
        return
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def end_rank_process() -> NoReturn:
    """End a rank that has left its group (`leave_process_group`) and written everything: flush the streams
    and logs, then exit without the interpreter's teardown. Even after leaving the group, a rank could still
    abort in that teardown under load ("terminate called without an active exception", SIGABRT after its
    last line: a native thread destroyed while joinable), failing a finished stage; nothing after the last
    line needs the teardown."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def shared_allreduce_buffer(rank: int) -> Path:
    """The shared-memory file DeepSpeed's CPU all-reduce creates for `rank` when all ranks share a node.

    DeepSpeed (ops/csrc/cpu/comm/shm.cpp) names it after the user, `MASTER_ADDR` and `MASTER_PORT` and
    never removes it: each two-rank CPU run would leave 2 x 69 MB in /dev/shm (RAM) for good.
    `init_process_group` unlinks this rank's file once every rank has mapped it; the mappings live on
    until the processes exit, as with any unlinked file.
    """
    address, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
    return Path("/dev/shm") / f"deepspeed_allreduce_buffer_{os.getuid()}_{address}_{port}_{rank}"


def stage_context(distributed: DistributedConfig) -> RankContext:
    """This process's rank for a training stage: checked against `distributed`, process group joined.

    A stage configured for several processes refuses to run alone (it would silently train with a
    fraction of the configured batch), and a launched one refuses a world size other than configured.
    """
    context = rank_context()
    if context.world_size != distributed.world_size:
        if not context.is_distributed:
            raise RankEnvironmentError(
                f"distributed.num_processes * num_nodes = {distributed.world_size}, but this process was not "
                "started by the deepspeed launcher (no WORLD_SIZE): the pipeline's stage tasks launch it, or "
                "run `deepspeed --num_gpus N --no_local_rank --module rlhf_core.stages.worker "
                "<stage> ...` "
                "(infra/deepspeed/README.md); set distributed.num_processes: 1 to run in this process"
            )
        raise RankEnvironmentError(
            f"launched with WORLD_SIZE={context.world_size}, but distributed.num_processes * num_nodes = "
            f"{distributed.world_size}"
        )
    init_process_group(context)
    return context
