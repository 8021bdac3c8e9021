"""The DeepSpeed config of one training engine, rendered from a template and the typed configuration.

Templates live in `infra/deepspeed/` (`zero2.json` for ZeRO stages 0-2, `zero3.json` for stage 3), or
wherever `distributed.config_template` points. They hold the tuning knobs that have no place in
params.yaml (bucket sizes, prefetching, persistence thresholds) and the value `"auto"` at every key the
pipeline owns: batch shape, gradient clipping, optimizer hyperparameters, bf16, ZeRO stage and optimizer
offload. Those come from params.yaml and the stage (`EngineSettings`); a template that pins one of them
is refused, so the DeepSpeed engine and the rest of the pipeline (batch plans, checkpoints, logs) can
never disagree about them. The optimizer is AdamW: torch's own (`torch_adam`, the single-process
path's exact update) on the device, DeepSpeed's CPU Adam when its states are offloaded.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlhf_core.config import ConfigError, DistributedConfig

TEMPLATE_DIR = Path(__file__).resolve().parents[2] / "infra" / "deepspeed"
AUTO = "auto"


@dataclass(frozen=True)
class EngineSettings:
    """What one engine's config takes from its stage: the per-rank batch shape and the optimizer."""

    micro_batch_size: int
    grad_accum_steps: int
    lr: float
    max_grad_norm: float | None
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8


def template_path(distributed: DistributedConfig) -> Path:
    """`distributed.config_template`, else the shipped template for the ZeRO stage."""
    if distributed.config_template is not None:
        return Path(distributed.config_template)
    return TEMPLATE_DIR / ("zero3.json" if distributed.zero_stage == 3 else "zero2.json")


def read_template(path: Path) -> dict[str, Any]:
    """A template's JSON object; a clear error when it is missing or not a JSON object."""
    if not path.is_file():
        raise ConfigError(f"distributed.config_template: DeepSpeed config template not found: {path}")
    try:
        template = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(template, dict):
        raise ConfigError(f"{path}: a DeepSpeed config must be a JSON object")
    return template


def owned_values(
    distributed: DistributedConfig, settings: EngineSettings, world_size: int, bf16: bool
) -> dict[tuple[str, ...], Any]:
    """Every key path the pipeline sets, with its value (`bf16`: DeepSpeed bf16, only sensible on CUDA)."""
    offload = {"device": "cpu", "pin_memory": True} if distributed.offload_optimizer else {"device": "none"}
    return {
        ("train_batch_size",): settings.micro_batch_size * settings.grad_accum_steps * world_size,
        ("train_micro_batch_size_per_gpu",): settings.micro_batch_size,
        ("gradient_accumulation_steps",): settings.grad_accum_steps,
        ("gradient_clipping",): settings.max_grad_norm if settings.max_grad_norm is not None else 0.0,
        ("optimizer", "params", "lr"): settings.lr,
        ("optimizer", "params", "betas"): list(settings.betas),
        ("optimizer", "params", "eps"): settings.eps,
        ("optimizer", "params", "weight_decay"): settings.weight_decay,
        ("optimizer", "params", "torch_adam"): not distributed.offload_optimizer,
        ("bf16", "enabled"): bf16,
        ("zero_optimization", "stage"): distributed.zero_stage,
        ("zero_optimization", "offload_optimizer"): offload,
    }


def _set_owned(config: dict[str, Any], path: tuple[str, ...], value: Any, source: Path) -> None:
    """Put `value` at `path`; the template may leave it out or say "auto", nothing else."""
    node = config
    for key in path[:-1]:
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{source}: {'.'.join(path[:-1])} must be a JSON object")
    current = node.get(path[-1], AUTO)
    if current != AUTO:
        raise ConfigError(
            f"{source}: {'.'.join(path)} is {current!r}, but params.yaml sets it (stage batch sizes, lr, "
            'max_grad_norm, distributed.*); write "auto" there'
        )
    node[path[-1]] = value


def _auto_paths(node: Any, prefix: str = "") -> list[str]:
    """Key paths whose value is still "auto"."""
    if isinstance(node, dict):
        return [path for key, value in node.items() for path in _auto_paths(value, f"{prefix}{key}.")]
    return [prefix.rstrip(".")] if node == AUTO else []


def render_deepspeed_config(
    distributed: DistributedConfig, settings: EngineSettings, world_size: int, bf16: bool
) -> dict[str, Any]:
    """The complete DeepSpeed config dict of one engine (`deepspeed.initialize(config=...)`)."""
    source = template_path(distributed)
    config = copy.deepcopy(read_template(source))
    for path, value in owned_values(distributed, settings, world_size, bf16).items():
        _set_owned(config, path, value, source)
    left = _auto_paths(config)
    if left:
        raise ConfigError(f'{source}: no value for {", ".join(left)} (only the pipeline\'s own keys may be "auto")')
    return config
