"""Rendering DeepSpeed configs from params.yaml (rlhf_core/distributed/deepspeed_config.py).

The rendered dicts are also parsed by DeepSpeed's own `DeepSpeedConfig`, which checks the batch-size
arithmetic and the ZeRO/offload schema, so a template that DeepSpeed would reject fails here.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlhf_core.config import ConfigError, DistributedConfig
from rlhf_core.distributed.deepspeed_config import EngineSettings, render_deepspeed_config, template_path

SETTINGS = EngineSettings(micro_batch_size=4, grad_accum_steps=8, lr=2e-5, max_grad_norm=1.0, weight_decay=0.1)


def deepspeed_accepts(config: dict) -> None:
    """DeepSpeed's own parser (one process here, so the batch arithmetic is checked for world size 1)."""
    from deepspeed.runtime.config import DeepSpeedConfig

    DeepSpeedConfig(config)


def test_zero2_config_carries_the_stage_batch_shape_and_optimizer() -> None:
    config = render_deepspeed_config(DistributedConfig(num_processes=8), SETTINGS, world_size=8, bf16=False)
    assert config["train_micro_batch_size_per_gpu"] == 4
    assert config["gradient_accumulation_steps"] == 8
    assert config["train_batch_size"] == 4 * 8 * 8
    assert config["gradient_clipping"] == 1.0
    assert config["optimizer"] == {
        "type": "AdamW",
        "params": {"lr": 2e-5, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.1, "torch_adam": True},
    }
    assert config["zero_optimization"]["stage"] == 2
    assert config["zero_optimization"]["offload_optimizer"] == {"device": "none"}
    assert config["zero_optimization"]["overlap_comm"] is True  # a template knob, kept as written
    assert config["bf16"] == {"enabled": False}
    deepspeed_accepts(render_deepspeed_config(DistributedConfig(), SETTINGS, world_size=1, bf16=False))


def test_zero3_with_offload_and_bf16_uses_deepspeeds_cpu_adam() -> None:
    distributed = DistributedConfig(num_processes=2, zero_stage=3, offload_optimizer=True, bf16=True)
    config = render_deepspeed_config(distributed, SETTINGS, world_size=1, bf16=True)
    assert template_path(distributed).name == "zero3.json"
    assert config["zero_optimization"]["stage"] == 3
    assert config["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is True
    assert config["optimizer"]["params"]["torch_adam"] is False  # DeepSpeedCPUAdam on the offloaded states
    assert config["bf16"] == {"enabled": True}
    deepspeed_accepts(config)


def test_no_clipping_renders_zero_and_stages_0_and_1_use_the_zero2_template() -> None:
    settings = EngineSettings(micro_batch_size=2, grad_accum_steps=1, lr=1e-3, max_grad_norm=None)
    for stage in (0, 1):
        distributed = DistributedConfig(zero_stage=stage)
        config = render_deepspeed_config(distributed, settings, world_size=1, bf16=False)
        assert template_path(distributed).name == "zero2.json"
        assert config["zero_optimization"]["stage"] == stage
        assert config["gradient_clipping"] == 0.0
        deepspeed_accepts(config)


def test_a_template_may_not_pin_what_params_yaml_sets(tmp_path: Path) -> None:
    template = json.loads(template_path(DistributedConfig()).read_text())
    template["gradient_accumulation_steps"] = 4
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(template))
    with pytest.raises(ConfigError, match='gradient_accumulation_steps is 4, but params.yaml sets it.*"auto"'):
        render_deepspeed_config(DistributedConfig(config_template=str(path)), SETTINGS, world_size=1, bf16=False)


def test_auto_outside_the_owned_keys_and_missing_templates_are_errors(tmp_path: Path) -> None:
    path = tmp_path / "mine.json"
    path.write_text(json.dumps({"zero_optimization": {"reduce_bucket_size": "auto"}}))
    with pytest.raises(ConfigError, match="no value for zero_optimization.reduce_bucket_size"):
        render_deepspeed_config(DistributedConfig(config_template=str(path)), SETTINGS, world_size=1, bf16=False)
    missing = DistributedConfig(config_template=str(tmp_path / "absent.json"))
    with pytest.raises(ConfigError, match="distributed.config_template: DeepSpeed config template not found"):
        render_deepspeed_config(missing, SETTINGS, world_size=1, bf16=False)


def test_distributed_section_validation_names_the_problem() -> None:
    with pytest.raises(ValueError, match="num_nodes > 1 needs a hostfile"):
        DistributedConfig(num_processes=8, num_nodes=2)
    with pytest.raises(ValueError, match="offload_optimizer needs zero_stage 2 or 3"):
        DistributedConfig(zero_stage=1, offload_optimizer=True)
    assert DistributedConfig(num_processes=8, num_nodes=2, hostfile="hosts").world_size == 16
