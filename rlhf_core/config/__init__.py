"""Typed configuration: `params.yaml` + overlays + `key.path=value` overrides -> one validated `Config`.

Each field's default and one-line meaning live on the field, in the module of its section; params.yaml
repeats the defaults for readers and DVC (tests/data/test_config_params.py keeps the two equal). Validation
happens at the edge, before any work starts: an unknown key, a wrong type or an out-of-range value raises
`ConfigError` naming the key path, the bad value and what is allowed. Stages receive the frozen section
they need; nothing else reads YAML or mutates a config.
"""

from rlhf_core.config.base import ConfigError, Section
from rlhf_core.config.data import DataConfig
from rlhf_core.config.distributed import DistributedConfig
from rlhf_core.config.evaluation import EvaluationConfig
from rlhf_core.config.generation import GenerationConfig, RolloutConfig
from rlhf_core.config.loader import deep_merge, load_config, parse_override, read_yaml_mapping
from rlhf_core.config.lora import LLAMA_LINEAR_LAYERS, LoraConfig
from rlhf_core.config.model import ModelConfig, TinyModelConfig
from rlhf_core.config.ppo import PPO_PRESETS, PRESET_SWITCHES, VANILLA_SWITCHES, CollapseGuardConfig, PPOConfig
from rlhf_core.config.registry import PromotionConfig, TrackingConfig
from rlhf_core.config.root import Config
from rlhf_core.config.training import RewardConfig, SFTConfig, TrainingConfig
from rlhf_core.config.validation import validate_config

__all__ = [
    "LLAMA_LINEAR_LAYERS",
    "PPO_PRESETS",
    "PRESET_SWITCHES",
    "VANILLA_SWITCHES",
    "CollapseGuardConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "DistributedConfig",
    "EvaluationConfig",
    "GenerationConfig",
    "LoraConfig",
    "ModelConfig",
    "PPOConfig",
    "PromotionConfig",
    "RewardConfig",
    "RolloutConfig",
    "SFTConfig",
    "Section",
    "TinyModelConfig",
    "TrackingConfig",
    "TrainingConfig",
    "deep_merge",
    "load_config",
    "parse_override",
    "read_yaml_mapping",
    "validate_config",
]
