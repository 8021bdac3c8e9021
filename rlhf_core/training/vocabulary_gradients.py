"""The vocabulary-sized matrices a model trains (LM head, input embedding) add their gradients into
``weight.grad`` in place.

They are the largest matrices a small causal LM trains (SmolLM2: 49152 x 576; the tiny test model's
49152 x 64 is 97% of its parameters). Through plain autograd, every micro-batch's backward writes each of
their gradients into a fresh vocabulary-sized tensor: the head's ``grad_logits^T @ hidden``, the
embedding's zero-filled matrix with the batch's rows scattered in (and, when the two are tied, the sum of
both in a third), which `AccumulateGrad` then adds to ``weight.grad``. Here:

- the head's backward is one matrix product that adds into ``weight.grad`` (``addmm_``; the first
  micro-batch of a step creates it), the gradient accumulation fusion Megatron-LM applies to its linears;
- an embedding tied to that head passes a sparse gradient, whose rows autograd adds to the same dense
  gradient in place;
- an untied embedding's backward adds the batch's rows into ``weight.grad`` (``index_add_``; created as
  zeros by the first micro-batch of a step).

The gradients are plain autograd's up to the order of float additions
(tests/training/test_training_vocabulary_gradients.py).
Measured on the tiny configuration's PPO learn phase: docs/rollout-engine.md, "Training".

Only for a process that owns its gradients (not under DeepSpeed, whose hooks take each gradient from
autograd) and trains in float32: under autocast both modules are their plain selves.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import PreTrainedModel


class _HeadProduct(torch.autograd.Function):
    """``hidden @ weight^T``; backward returns the input's gradient and adds the weight's to ``weight.grad``."""

    @staticmethod
    def forward(ctx: Any, hidden: Tensor, weight: Tensor) -> Tensor:
        ctx.save_for_backward(hidden, weight)
        return F.linear(hidden, weight)

    @staticmethod
    def backward(ctx: Any, grad_logits: Tensor) -> tuple[Tensor, None]:
        hidden, weight = ctx.saved_tensors
        rows = grad_logits.reshape(-1, grad_logits.shape[-1]).t()  # [vocab, N]
        inputs = hidden.reshape(-1, hidden.shape[-1])  # [N, hidden]
        if weight.grad is None:
            weight.grad = rows @ inputs
        else:
            weight.grad.addmm_(rows, inputs)
        return grad_logits @ weight, None


class _EmbeddingLookup(torch.autograd.Function):
    """``weight[ids]``; backward adds the rows' gradients into ``weight.grad`` (none to `padding_idx`)."""

    @staticmethod
    def forward(ctx: Any, ids: Tensor, weight: Tensor, padding_idx: int | None) -> Tensor:
        ctx.save_for_backward(ids)
        ctx.weight, ctx.padding_idx = weight, padding_idx
        return F.embedding(ids, weight, padding_idx)

    @staticmethod
    def backward(ctx: Any, grad_rows: Tensor) -> tuple[None, None, None]:
        (ids,) = ctx.saved_tensors
        weight = ctx.weight
        ids, grad_rows = ids.reshape(-1), grad_rows.reshape(-1, grad_rows.shape[-1])
        if ctx.padding_idx is not None:
            grad_rows = grad_rows.masked_fill((ids == ctx.padding_idx)[:, None], 0.0)
        if weight.grad is None:
            weight.grad = torch.zeros_like(weight)
        weight.grad.index_add_(0, ids, grad_rows.to(weight.dtype))
        return None, None, None


def _fused(weight: Tensor, reference: Tensor) -> bool:
    """Whether a forward with `weight` on `reference`'s device takes the in-place path."""
    return torch.is_grad_enabled() and weight.requires_grad and not torch.is_autocast_enabled(reference.device.type)


class InPlaceGradientHead(nn.Linear):
    """A bias-free LM head sharing `weight` (the same Parameter, so a tied embedding stays tied)."""

    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__(weight.shape[1], weight.shape[0], bias=False, device="meta")
        self.weight = weight

    def forward(self, hidden: Tensor) -> Tensor:
        if _fused(self.weight, hidden):
            return _HeadProduct.apply(hidden, self.weight)
        return F.linear(hidden, self.weight)


class InPlaceGradientEmbedding(nn.Embedding):
    """An untied input embedding sharing `embedding`'s weight and padding index."""

    def __init__(self, embedding: nn.Embedding) -> None:
        rows, width = embedding.weight.shape
        super().__init__(rows, width, padding_idx=embedding.padding_idx, device="meta")
        self.weight = embedding.weight

    def forward(self, ids: Tensor) -> Tensor:
        if _fused(self.weight, self.weight):
            return _EmbeddingLookup.apply(ids, self.weight, self.padding_idx)
        return F.embedding(ids, self.weight, self.padding_idx)


def accumulate_vocabulary_gradients_in_place(model: PreTrainedModel) -> list[str]:
    """Switch `model`'s trainable head and input embedding to in-place accumulation (module doc); returns
    what was switched (``"head"``, ``"tied embedding"``, ``"embedding"``).

    A frozen matrix, a head with a bias and an embedding with options of its own (`max_norm`,
    `scale_grad_by_freq`, sparse gradients) or that is not an `nn.Embedding` are left alone.
    With a tied head, call it only where every loss reads the head's logits (the SFT model, the PPO
    policy): the embedding's sparse gradient must meet the head's dense one before the optimizer sees it.
    Calling it again changes nothing further.
    """
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    switched = []
    if isinstance(head, nn.Linear) and head.bias is None and head.weight.requires_grad:
        if not isinstance(head, InPlaceGradientHead):
            model.set_output_embeddings(InPlaceGradientHead(head.weight))
        switched.append("head")
    if "head" in switched and isinstance(embedding, nn.Embedding) and embedding.weight is head.weight:
        embedding.sparse = True
        return [*switched, "tied embedding"]
    if not _plain_trainable_embedding(embedding):
        return switched
    if not isinstance(embedding, InPlaceGradientEmbedding):
        model.set_input_embeddings(InPlaceGradientEmbedding(embedding))
    return [*switched, "embedding"]


def _plain_trainable_embedding(embedding: nn.Module) -> bool:
    """A trainable `nn.Embedding` whose backward is a plain scatter of rows."""
    return (
        isinstance(embedding, nn.Embedding)
        and embedding.weight.requires_grad
        and embedding.max_norm is None
        and not embedding.scale_grad_by_freq
        and not embedding.sparse
    )
