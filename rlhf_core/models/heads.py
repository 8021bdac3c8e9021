"""Scalar heads on a decoder backbone: the reward model and the PPO critic.

RewardModel (paper section 3.1, eq. 1-2): r(x, y) is a Linear(hidden, 1) WITH bias applied to the final
hidden state at the token that ends the reply (`reply_end_positions`). It can keep the base model's LM
head (tied to the embeddings or not, as the base model was) so reward-model training can add the paper's
language-modelling term on the preferred reply (eq. 2).

Critic (section 3.2): the same kind of head applied at EVERY position, giving a value estimate V(s_t) per
token. PPO-max initialises it from the reward model (`Critic.from_reward_model` / a saved reward model dir).

Both feed the backbone position ids computed from the attention mask, so a left-padded sequence gets
the same positions, and hence the same outputs, as the unpadded one. (Rotary models such as Llama are
shift-invariant anyway; backbones with absolute position embeddings are not.)
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from rlhf_core.models.blocks import final_hidden_states
from rlhf_core.models.chat import reply_end_positions
from rlhf_core.models.loading import DEFAULT_DEVICE, DEFAULT_DTYPE
from rlhf_core.models.saving import HeadConfig, load_scalar_head_model, save_scalar_head_model


def in_float32(head: nn.Module, hidden: Tensor) -> Tensor:
    """`head(hidden)` in the head's own dtype, not bf16 autocast's, returned in float32 or wider: a float32
    model's heads compute in float32 also under autocast (docs/scale-out.md, "Precision").

    A head's outputs decide what must stay exact: logits make the log-probabilities of the cross-entropy,
    the PPO ratio and the KL; scalar heads make rewards, margins and values. bf16 keeps 8 bits of mantissa,
    so logits of 16-32 would be 0.125 apart and a score of 2 0.008 from its neighbour (judge ties, ratio
    noise). The heads are a small share of a pass (the LM head runs on reply positions only).
    """
    with torch.autocast(hidden.device.type, enabled=False):
        outputs = head(hidden.to(next(head.parameters()).dtype))
    return outputs.float() if outputs.dtype in (torch.float16, torch.bfloat16) else outputs


def new_scalar_head(backbone: PreTrainedModel, seed: int) -> nn.Linear:
    """Linear(hidden, 1) with bias, weight ~ N(0, 1/(hidden+1)) and zero bias, drawn from `seed`.

    The small weight keeps initial scores near zero and of unit-order spread whatever the hidden size.
    Created in the backbone's dtype and on its device.
    """
    hidden_size = backbone.config.hidden_size
    embeddings = backbone.get_input_embeddings().weight
    generator = torch.Generator().manual_seed(seed)
    head = nn.Linear(hidden_size, 1, bias=True)
    with torch.no_grad():
        head.weight.copy_(torch.randn(1, hidden_size, generator=generator) / math.sqrt(hidden_size + 1))
        head.bias.zero_()
    return head.to(device=embeddings.device, dtype=embeddings.dtype)


def _lm_head_mode(lm_head: nn.Linear | None, backbone: PreTrainedModel) -> str:
    """ "none", "tied" (shares the input-embedding matrix) or "separate"."""
    if lm_head is None:
        return "none"
    return "tied" if lm_head.weight is backbone.get_input_embeddings().weight else "separate"


@dataclass
class RewardOutput:
    """scores [B]: r(x, y) per sequence; lm_logits [B, T, V] when asked for (for the eq. 2 LM term)."""

    scores: Tensor
    lm_logits: Tensor | None


class RewardModel(nn.Module):
    """Backbone + scalar head read at the end of the reply: r(x, y) of the paper's eq. (1)."""

    def __init__(
        self,
        backbone: PreTrainedModel,
        score_head: nn.Linear,
        eot_id: int,
        lm_head: nn.Linear | None = None,
        length_slope: float = 0.0,
    ):
        super().__init__()
        if score_head.out_features != 1 or score_head.bias is None:
            raise ValueError("score_head must be a Linear(hidden, 1) with bias")
        self.backbone = backbone
        self.score_head = score_head
        self.lm_head = lm_head
        self.eot_id = eot_id
        # A training-only head of `reward.length_debias` (rlhf_core/reward/length_debias.py): it takes the
        # length out of score_head during training and is never saved, so everything that loads the
        # model (PPO, the judge) scores with score_head alone.
        self.length_head: nn.Module | None = None
        # `reward.length_debias: length_residual`: r(x, y) = head - length_slope * log(1 + |y|), the slope
        # fitted after training (rlhf_core/reward/length_debias.py) and saved in head_config.json.
        self.length_slope = length_slope

    @classmethod
    def from_causal_lm(cls, lm: PreTrainedModel, eot_id: int, keep_lm_head: bool = False, seed: int = 0) -> RewardModel:
        """Take the causal LM's backbone (and, if asked, its LM head, tied or not) and add a fresh head.

        The modules are shared with `lm`, not copied: pass a model you hand over (e.g. a freshly loaded
        SFT model).
        """
        backbone = lm.base_model
        lm_head = lm.get_output_embeddings() if keep_lm_head else None
        return cls(backbone, new_scalar_head(backbone, seed), eot_id, lm_head)

    @classmethod
    def from_pretrained(
        cls, directory: str | Path, dtype: torch.dtype = DEFAULT_DTYPE, device: str | torch.device = DEFAULT_DEVICE
    ) -> RewardModel:
        """Load a directory written by `save_pretrained`, in eval mode."""
        parts = load_scalar_head_model(directory, dtype=dtype, device=device)
        if parts.head_config.kind != "reward_model" or parts.head_config.eot_id is None:
            raise ValueError(f"{directory} holds a {parts.head_config.kind}, not a reward model")
        config = parts.head_config
        return cls(parts.backbone, parts.head, config.eot_id, parts.lm_head, config.length_slope).eval()

    def save_pretrained(self, out_dir: str | Path, tokenizer: PreTrainedTokenizerBase) -> Path:
        """Save backbone (HF format), head, LM head if untied, tokenizer and head_config.json atomically."""
        mode = _lm_head_mode(self.lm_head, self.backbone)
        head_config = HeadConfig(
            kind="reward_model",
            hidden_size=self.score_head.in_features,
            eot_id=self.eot_id,
            lm_head=mode,
            length_slope=self.length_slope,
        )
        separate_lm_head = self.lm_head if mode == "separate" else None
        return save_scalar_head_model(out_dir, self.backbone, self.score_head, tokenizer, head_config, separate_lm_head)

    def forward(
        self, input_ids: Tensor, attention_mask: Tensor, reply_start: Tensor | int, return_lm_logits: bool = False
    ) -> RewardOutput:
        """Scores [B] read at `reply_end_positions(...)`; LM logits [B, T, V] too when `return_lm_logits`.

        input_ids, attention_mask: [B, T], left or right padded; reply_start: [B] or int (see chat.py).
        """
        hidden = final_hidden_states(self.backbone, input_ids, attention_mask)
        scores = self.scores_from_hidden(hidden, input_ids, attention_mask, reply_start)
        if not return_lm_logits:
            return RewardOutput(scores=scores, lm_logits=None)
        if self.lm_head is None:
            raise ValueError("return_lm_logits=True but this reward model was built without its LM head")
        return RewardOutput(scores=scores, lm_logits=in_float32(self.lm_head, hidden))

    def scores_from_hidden(
        self, hidden: Tensor, input_ids: Tensor, attention_mask: Tensor, reply_start: Tensor | int
    ) -> Tensor:
        """Scores [B]: the score head on the final hidden states [B, T, H] at each reply's end-of-turn token."""
        ends = reply_end_positions(input_ids, attention_mask, self.eot_id, reply_start)
        end_hidden = hidden[torch.arange(hidden.shape[0], device=hidden.device), ends]  # [B, H]
        return self.scores_at_ends(end_hidden, ends - torch.as_tensor(reply_start, device=ends.device))

    def scores_at_ends(self, end_hidden: Tensor, reply_tokens: Tensor) -> Tensor:
        """r(x, y) [B] from the final hidden state at each reply's end [B, H] and the reply's length in
        tokens [B]: the score head, less the length slope's share (0 unless `length_residual`)."""
        return less_length_share(in_float32(self.score_head, end_hidden).squeeze(-1), reply_tokens, self.length_slope)


def less_length_share(scores: Tensor, reply_tokens: Tensor, slope: float) -> Tensor:
    """`scores` [B] less `slope` times log(1 + `reply_tokens` [B]): a length slope's share taken out
    (`length_residual`, docs/length-debias.md)."""
    if slope == 0.0:
        return scores
    return scores - slope * torch.log1p(reply_tokens.to(scores.dtype))


class Critic(nn.Module):
    """Backbone + scalar head at every position: V(s_t) [B, T] for PPO's generalised advantage estimation."""

    def __init__(self, backbone: PreTrainedModel, value_head: nn.Linear):
        super().__init__()
        if value_head.out_features != 1 or value_head.bias is None:
            raise ValueError("value_head must be a Linear(hidden, 1) with bias")
        self.backbone = backbone
        self.value_head = value_head

    @classmethod
    def from_causal_lm(cls, lm: PreTrainedModel, seed: int = 0) -> Critic:
        """Take the causal LM's backbone (shared, not copied) and add a fresh value head."""
        return cls(lm.base_model, new_scalar_head(lm.base_model, seed))

    @classmethod
    def from_reward_model(cls, reward_model: RewardModel) -> Critic:
        """A critic initialised as PPO-max does: an independent copy of the reward model's backbone and head."""
        return cls(copy.deepcopy(reward_model.backbone), copy.deepcopy(reward_model.score_head))

    @classmethod
    def from_pretrained(
        cls, directory: str | Path, dtype: torch.dtype = DEFAULT_DTYPE, device: str | torch.device = DEFAULT_DEVICE
    ) -> Critic:
        """Load a saved critic, or a saved reward model as the critic's initialisation (dropping its LM head)."""
        parts = load_scalar_head_model(directory, dtype=dtype, device=device)
        return cls(parts.backbone, parts.head).eval()

    def save_pretrained(self, out_dir: str | Path, tokenizer: PreTrainedTokenizerBase) -> Path:
        """Save backbone (HF format), value head, tokenizer and head_config.json atomically."""
        head_config = HeadConfig(kind="critic", hidden_size=self.value_head.in_features, eot_id=None, lm_head="none")
        return save_scalar_head_model(out_dir, self.backbone, self.value_head, tokenizer, head_config)

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """Values [B, T] (values at padded positions are meaningless; mask them)."""
        return self.values_from_hidden(final_hidden_states(self.backbone, input_ids, attention_mask))

    def values_from_hidden(self, hidden: Tensor) -> Tensor:
        """Values [B, T]: the value head on the final hidden states [B, T, H] at every position."""
        return in_float32(self.value_head, hidden).squeeze(-1)
