"""The engine a `RolloutConfig` names (`ppo.rollout.engine`, `evaluation.generation.engine`), built for a model.

Its own module because it chooses between the protocol's reference engine (engine.py) and the lean one
(lean_engine.py), which itself builds on engine.py.
"""

from __future__ import annotations

from transformers import PreTrainedModel

from rlhf_core.config import RolloutConfig
from rlhf_core.rollout.engine import HFGenerateEngine, RolloutEngine
from rlhf_core.rollout.lean_engine import LeanEngine, weights_dtype


def make_rollout_engine(
    settings: RolloutConfig, policy: PreTrainedModel, rollout_batch_size: int, trunk_layers: int | None = None
) -> RolloutEngine:
    """The engine `settings.engine` names; the lean one copies `policy`'s weights now and, given the shared
    trunk's `trunk_layers`, hands back its states when it computes in the policy's dtype."""
    if settings.engine == "hf":
        return HFGenerateEngine(policy)
    same_dtype = weights_dtype(settings, policy) == next(policy.parameters()).dtype
    return LeanEngine(policy, settings, rollout_batch_size, trunk_layers if same_dtype else None)
