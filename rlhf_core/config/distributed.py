"""`distributed:` scale-out with DeepSpeed ZeRO (infra/deepspeed/README.md)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

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
    bf16: Literal["auto", "on", "off"] = Field(
        "off",
        description="bf16 autocast (fp32 master weights) for training, scoring and generation. auto: on a GPU with "
        "bf16, on a CPU whose bf16 matmul is measurably faster (rlhf_core/bf16_probe.py); on, off: always, never. "
        "off by default: auto made the whole 2-core CPU run slower (docs/scale-out.md, Precision).",
    )
    config_template: str | None = Field(
        None, description="A DeepSpeed JSON template; null: infra/deepspeed/zero2.json or zero3.json."
    )

    @field_validator("bf16", mode="before")
    @classmethod
    def _yaml_booleans(cls, value: object) -> object:
        """YAML reads `on`/`off` (and older files' `true`/`false`) as booleans: take them as on and off."""
        if isinstance(value, bool):
            return "on" if value else "off"
        return value

    @property
    def uses_bf16(self) -> bool:
        """Whether the resolved setting computes in bf16; `auto` must be resolved for the device first
        (rlhf_core/stages/precision.py)."""
        if self.bf16 == "auto":
            raise ValueError("distributed.bf16 is auto: resolve it for the device first (stages/precision.py)")
        return self.bf16 == "on"

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
