"""`distributed:` scale-out with DeepSpeed ZeRO (infra/deepspeed/README.md)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from rlhf_core.config.base import Section


class DistributedConfig(Section):
    """Scale-out with DeepSpeed ZeRO; one process by default (rlhf_core/distributed, infra/deepspeed/).

    With `num_processes > 1` the SFT, reward-model and PPO stages run under the `deepspeed` launcher,
    `num_processes` ranks on each of `num_nodes` machines; the batch sizes of each stage are per rank.
    """

    num_processes: int = Field(1, ge=1, description="Processes (GPUs) per node; 1 runs in-process.")
    num_nodes: int = Field(1, ge=1, description="Machines; more than 1 needs `hostfile`.")
    hostfile: str | None = Field(None, description="DeepSpeed hostfile: one `host slots=N` line per node.")
    master_addr: str | None = Field(None, description="Rank 0's address; null: 127.0.0.1 or the first host.")
    master_port: int = Field(29500, ge=1024, le=65535, description="Rank 0's rendezvous port.")
    zero_stage: Literal[0, 1, 2, 3] = Field(
        2, description="ZeRO partitions optimizer states (1), + gradients (2), + weights (3)."
    )
    offload_optimizer: bool = Field(False, description="Keep optimizer states in CPU memory (ZeRO 2/3).")
    bf16: bool = Field(False, description="bf16 autocast on CUDA; CPU always trains in fp32.")
    config_template: str | None = Field(
        None, description="A DeepSpeed JSON template; null: infra/deepspeed/zero2.json or zero3.json."
    )

    @model_validator(mode="after")
    def _launch_is_possible(self) -> DistributedConfig:
        if self.num_nodes > 1 and not self.hostfile:
            raise ValueError("num_nodes > 1 needs a hostfile naming the nodes (see infra/deepspeed/README.md)")
        if self.offload_optimizer and self.zero_stage < 2:
            raise ValueError("offload_optimizer needs zero_stage 2 or 3")
        return self

    @property
    def world_size(self) -> int:
        """Ranks in all: processes per node times nodes."""
        return self.num_processes * self.num_nodes
