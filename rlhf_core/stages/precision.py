"""A stage's precision, decided where it runs: `distributed.bf16` and the rollout dtypes made concrete.

Each stage calls `resolve_precision` first, on the device it computes on, so the decision follows the
machine (a pool's workers may differ) and everything after it reads one resolved `Config`: the training
loop's autocast, the scoring passes, the engines' dtypes, and the run records and fingerprints, which so
name the precision a run really used (a checkpoint written in bf16 is not resumed in float32). The
choice and its reason are logged, and recorded with the stage's parameters (`precision_record`). How it is
decided: rlhf_core/training/precision.py.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from rlhf_core.bf16_probe import cached_rates
from rlhf_core.config import Config
from rlhf_core.models.gguf_cache import default_cache_dir
from rlhf_core.training.precision import PrecisionChoice, choose_precision

log = logging.getLogger(__name__)

PROBE_FILE = Path("bf16-probe.json")  # under $RLHF_CACHE_DIR, beside the model cache


def choose_for(config: Config, device: torch.device) -> PrecisionChoice:
    """`config.distributed.bf16` decided for `device` (a CPU's rates from the probe's cache file)."""
    return choose_precision(config.distributed.bf16, device, lambda: cached_rates(default_cache_dir(PROBE_FILE)))


def with_precision(config: Config, bf16: bool) -> Config:
    """`config` with `distributed.bf16` on or off and both rollout dtypes (PPO's, the evaluation's) concrete."""
    distributed = config.distributed.model_copy(update={"bf16": "on" if bf16 else "off"})
    ppo = config.ppo.model_copy(update={"rollout": config.ppo.rollout.for_precision(bf16)})
    generation = config.evaluation.generation.for_precision(bf16)
    evaluation = config.evaluation.model_copy(update={"generation": generation})
    return config.model_copy(update={"distributed": distributed, "ppo": ppo, "evaluation": evaluation})


def precision_record(resolved: Config) -> dict[str, str]:
    """What a stage logs of its resolved precision (under the key `precision`), beside its requested settings:
    the MLflow run already holds those as asked (`auto`), and a logged parameter cannot change."""
    return {
        "bf16": resolved.distributed.bf16,
        "ppo_rollout_dtype": resolved.ppo.rollout.dtype,
        "evaluation_generation_dtype": resolved.evaluation.generation.dtype,
    }


def resolve_precision(config: Config, device: torch.device, stage: str) -> Config:
    """`config` resolved for `device` (`with_precision`), the choice logged with `stage`'s name."""
    choice = choose_for(config, device)
    log.info("%s computes in %s: %s", stage, "bf16" if choice.bf16 else "float32", choice.reason)
    return with_precision(config, choice.bf16)
