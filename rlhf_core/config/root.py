"""The whole configuration: one field per params.yaml section."""

from __future__ import annotations

import hashlib
import json

from pydantic import Field

from rlhf_core.config.base import Section
from rlhf_core.config.data import DataConfig
from rlhf_core.config.distributed import DistributedConfig
from rlhf_core.config.evaluation import EvaluationConfig
from rlhf_core.config.model import ModelConfig
from rlhf_core.config.ppo import PPOConfig
from rlhf_core.config.registry import PromotionConfig, TrackingConfig
from rlhf_core.config.training import RewardConfig, SFTConfig


class Config(Section):
    """Every hyperparameter of the pipeline, as resolved from params.yaml + overlays + overrides."""

    seed: int = Field(42, description="Seeds every stage (data order, initialisation, sampling).")
    data: DataConfig = DataConfig()
    model: ModelConfig = ModelConfig()
    sft: SFTConfig = SFTConfig()
    reward: RewardConfig = RewardConfig()
    ppo: PPOConfig = PPOConfig()
    evaluation: EvaluationConfig = EvaluationConfig()
    tracking: TrackingConfig = TrackingConfig()
    promotion: PromotionConfig = PromotionConfig()
    distributed: DistributedConfig = DistributedConfig()

    def section_hash(self, name: str) -> str:
        """A short content hash of one section (cache keys, lineage tags)."""
        payload = json.dumps(getattr(self, name).model_dump(mode="json"), sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:16]
