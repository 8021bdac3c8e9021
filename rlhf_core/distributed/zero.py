"""ZeRO-3 weight gathering: whole-model access to weights that ZeRO-3 partitions across ranks.

Under ZeRO stage 3 each rank holds only a slice of every weight; a forward pass gathers each layer's
weights just before the layer runs and frees them after. That is right for training, but two uses need
the whole model at once:

* generation: `generate` runs one forward pass per new token, so per-layer gathering would move every
  weight across the network once PER TOKEN. `gathered_for_generation(engine)` gathers them once for the
  whole block and takes the engine's per-layer hooks off meanwhile (DeepSpeed's
  `unwrap_model_for_generation`): merely gathering is not enough, since the hooks would release each
  layer after its forward pass and fetch it again for the next token.
* saving: the full weights must be in one place to be written (`gathered_parameters(module)`, DeepSpeed's
  `GatheredParameters`).

Both are collectives (every rank must enter them, for the same model) and cost one full copy of the
model's weights per rank while open. For models that are not ZeRO-3 partitioned (one process, ZeRO
0-2) they do nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import nn


def is_partitioned(module: nn.Module) -> bool:
    """Whether ZeRO-3 manages `module`'s weights (DeepSpeed tags each such parameter with a `ds_id`)."""
    return any(hasattr(parameter, "ds_id") for parameter in module.parameters())


@contextlib.contextmanager
def gathered_parameters(module: nn.Module) -> Iterator[None]:
    """Make every weight of `module` whole on this rank for the duration of the block (read-only use)."""
    if not is_partitioned(module):
        yield
        return
    from deepspeed.runtime.zero import GatheredParameters

    with GatheredParameters(list(module.parameters()), modifier_rank=None):
        yield


@contextlib.contextmanager
def gathered_for_generation(engine: Any | None) -> Iterator[None]:
    """Make a ZeRO-3 engine's module whole, without per-layer hooks, for the block (no training in it).

    `engine` is a DeepSpeed engine, or None for a model that no engine manages (one process).
    """
    if engine is None or not is_partitioned(engine.module):
        yield
        return
    from deepspeed.runtime.zero.stage3 import unwrap_model_for_generation

    with unwrap_model_for_generation(engine):
        yield
