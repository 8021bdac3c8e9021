"""The frozen lower blocks PPO's four models have in common, run once per rollout instead of six times.

With `ppo.trainable_top_layers = n` the policy and the critic never change their embedding and lower
`L - n` blocks. The reference is a frozen copy of the SFT model, and the reward model - so the critic
initialised from it - is the SFT model with its top blocks trained (`reward.trainable_top_layers`). So
under the CPU defaults (top 4 of SmolLM2's 30 blocks everywhere) all four models hold bit-identical copies
of the lower 26 blocks, and an iteration used to run them six times over the same tokens: policy and
reference log-probs, critic values and the reward model's score in the rollout, then the critic and the
policy forward again in the update. The residual stream those blocks produce is the same every time, so
`SharedTrunk` computes it once per rollout micro-batch (with the policy's copy), keeps it in the
`Experience`, and every pass runs only its model's upper blocks from it. The update reuses it too: no
gradient flows into frozen blocks, so the update's forward needs nothing below block `L - n`.

Stored once, too (`share_storage`): the reference and the reward model then hold the policy's tensors for
those blocks instead of their own bit-identical copies, and fresh copies of the rest, so that the
checkpoint files transformers memory-maps them from are released (for SmolLM2 the process's resident set
drops by 0.86 GB), which more than pays for the lean rollout engine's own copy of the policy
(rlhf_core/rollout/decode_weights.py). The critic keeps its copy: it is checkpointed with the policy, and a
checkpoint stores each tensor once.

Nothing is assumed: `find_shared_trunk` compares the weights. A model whose lower blocks differ from the
policy's (a reward model trained on more blocks, a bf16 reference next to a float32 policy, a critic with
adapters in every block) is simply not a member and runs its full forward. Single process only: under the
DeepSpeed launcher the trained models are engine-wrapped (ZeRO-3 even partitions their weights), so the
trainer does not share there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn
from transformers import PreTrainedModel

from rlhf_core.models.blocks import lower_residual
from rlhf_core.ppo.scoring import chunks
from rlhf_core.ppo.sequences import TrunkStates, joined_sequence

MEMBERS = ("reference", "critic", "reward_model")


def _blocks(backbone: nn.Module) -> nn.ModuleList:
    layers = getattr(backbone, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"{type(backbone).__name__} has no `layers` ModuleList of transformer blocks")
    return layers


def lower_parameters(backbone: nn.Module, num_lower: int) -> list[tuple[str, Tensor]]:
    """(name, tensor) of the input embedding and blocks ``0 .. num_lower - 1``, in a fixed order."""
    named = [("embed", backbone.get_input_embeddings().weight)]
    for index, block in enumerate(list(_blocks(backbone))[:num_lower]):
        named += [(f"layers.{index}.{name}", tensor) for name, tensor in block.state_dict().items()]
    return named


def _lower_modules(backbone: nn.Module, num_lower: int) -> list[nn.Module]:
    """The input embedding and blocks ``0 .. num_lower - 1``."""
    return [backbone.get_input_embeddings(), *list(_blocks(backbone))[:num_lower]]


def is_frozen(backbone: nn.Module, num_lower: int) -> bool:
    """No parameter of the embedding or the lower `num_lower` blocks can receive a gradient."""
    return not any(p.requires_grad for module in _lower_modules(backbone, num_lower) for p in module.parameters())


def same_lower_blocks(source: nn.Module, other: nn.Module, num_lower: int) -> bool:
    """`other` holds exactly `source`'s lower blocks: same names, dtypes, devices and values."""
    if len(_blocks(other)) < num_lower:
        return False
    mine, theirs = lower_parameters(source, num_lower), lower_parameters(other, num_lower)
    return len(mine) == len(theirs) and all(
        name == other_name
        and tensor.dtype == other_tensor.dtype
        and tensor.device == other_tensor.device
        and torch.equal(tensor, other_tensor)
        for (name, tensor), (other_name, other_tensor) in zip(mine, theirs, strict=True)
    )


@dataclass(frozen=True)
class SharedTrunk:
    """The lower `num_lower` blocks of the policy's backbone, which the `members` hold identical copies of."""

    backbone: PreTrainedModel
    """The policy's backbone: the copy that computes the shared residual stream."""
    num_lower: int
    members: frozenset[str]
    """Which other models read from it: a subset of "reference", "critic", "reward_model"."""

    def serves(self, model: str) -> bool:
        """Whether `model` ("policy" or one of `MEMBERS`) starts its passes from the shared stream."""
        return model == "policy" or model in self.members

    @torch.no_grad()
    def states(
        self, prompt: tuple[Tensor, Tensor], response: tuple[Tensor, Tensor], micro_batch_size: int
    ) -> TrunkStates:
        """The residual stream ``[B, P + T, H]`` of a rollout, `micro_batch_size` rows per pass.

        Each micro-batch runs on its own `joined_sequence` columns, the very input its models' passes
        would have had; columns no micro-batch kept stay 0 (padding in every row that reads them).
        """
        prompt_ids, prompt_mask = prompt
        response_ids, response_mask = response
        rows_total, width = prompt_ids.shape[0], prompt_ids.shape[1] + response_ids.shape[1]
        residual: Tensor | None = None
        for rows in chunks(rows_total, micro_batch_size):
            joined = joined_sequence(prompt_ids[rows], prompt_mask[rows], response_ids[rows], response_mask[rows])
            part = lower_residual(self.backbone, joined.input_ids, joined.attention_mask, self.num_lower)
            if residual is None:
                residual = part.new_zeros(rows_total, width, part.shape[-1])
            residual[rows, joined.columns] = part
        assert residual is not None
        return TrunkStates(residual, self.num_lower)


def share_storage(trunk: SharedTrunk, frozen: dict[str, tuple[nn.Module, nn.Module]]) -> int:
    """Let the frozen `trunk` members in `frozen` (name -> (backbone, the whole model holding it)) read the
    policy's lower-block tensors instead of their own copies; returns the bytes no longer duplicated.

    Safe because the copies are bit-identical (a member's condition) and neither side ever changes them:
    the policy's lower blocks are frozen, and only "reference" and "reward_model" are accepted, which
    never train. Each member gets new Parameter objects over the policy's storage, so converting or
    moving a member later (`.to(...)`) still touches only that member; a parameter the member ties to
    its embedding (a tied LM head) is re-pointed with it. The member's other parameters are replaced by
    copies: a model loaded from safetensors holds memory-mapped views of its file, and the mapping (with
    every page of it read so far) stays resident while any view of it is alive.
    """
    released = 0
    for name, (backbone, model) in frozen.items():
        if name not in trunk.members or name not in ("reference", "reward_model"):
            continue
        shared: dict[int, nn.Parameter] = {}
        pairs = zip(_lower_modules(trunk.backbone, trunk.num_lower), _lower_modules(backbone, trunk.num_lower))
        for mine, theirs in pairs:
            for source, target in zip(mine.parameters(), theirs.parameters(), strict=True):
                shared[id(target)] = nn.Parameter(source.detach(), requires_grad=False)
                released += target.numel() * target.element_size()
        for module in model.modules():
            for key, parameter in list(module.named_parameters(recurse=False)):
                if id(parameter) in shared:
                    setattr(module, key, shared[id(parameter)])
                else:
                    parameter.data = parameter.data.clone()
    return released


def find_shared_trunk(
    policy: PreTrainedModel, others: dict[str, nn.Module | None], trainable_top_layers: int | None
) -> SharedTrunk | None:
    """The trunk the policy shares with the models in `others` (backbones by `MEMBERS` name), or None.

    None when the policy trains every block (`trainable_top_layers` None) or no other model holds the
    same frozen lower blocks. A model is a member when its lower blocks equal the policy's bit for bit
    and, for the critic (the other model that trains), are frozen; the reference and the reward model
    only ever run without gradients.
    """
    unknown = set(others) - set(MEMBERS)
    if unknown:
        raise ValueError(f"unknown models {sorted(unknown)}; expected some of {MEMBERS}")
    backbone = policy.base_model
    if trainable_top_layers is None:
        return None
    num_lower = len(_blocks(backbone)) - trainable_top_layers
    if num_lower < 1 or not is_frozen(backbone, num_lower):
        return None
    members = frozenset(
        name
        for name, other in others.items()
        if other is not None
        and (name != "critic" or is_frozen(other, num_lower))
        and same_lower_blocks(backbone, other, num_lower)
    )
    if not members:
        return None
    return SharedTrunk(backbone=backbone, num_lower=num_lower, members=members)
