"""The head and embedding that add their gradients into ``weight.grad`` in place: plain autograd's gradients
over micro-batches and steps (tied and untied, padding row included), the same outputs and saved model,
and no change where they must not apply (frozen, no grad, autocast, embeddings with options)."""

from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import LlamaForCausalLM

from fixtures.parameters import small_llama
from rlhf_core.models.freezing import freeze_all_but_top_layers
from rlhf_core.training.vocabulary_gradients import (
    InPlaceGradientEmbedding,
    InPlaceGradientHead,
    accumulate_vocabulary_gradients_in_place,
)

VOCAB = 40
PAD = 3


def llama(tied: bool) -> LlamaForCausalLM:
    narrow = {"vocab_size": VOCAB, "hidden_size": 16, "intermediate_size": 32}
    return small_llama(0, **narrow, tie_word_embeddings=tied, pad_token_id=PAD)


def token_ids(rows: int, seed: int) -> torch.Tensor:
    ids = torch.randint(0, VOCAB, (rows, 9), generator=torch.Generator().manual_seed(seed))
    ids[:, :2] = PAD  # the padding row's gradient must stay zero
    return ids


def gradients_of_two_steps(model: LlamaForCausalLM, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """Every parameter's gradient after a step of two micro-batches and after a next step of one (the
    gradients set to None in between, as the optimizers do)."""
    gradients = {}
    for step, micro_batches in enumerate(((ids[:2], ids[2:4]), (ids[4:],))):
        model.zero_grad(set_to_none=True)
        for rows in micro_batches:
            logits = model(input_ids=rows).logits
            nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), rows[:, 1:].flatten()).backward()
        gradients.update({f"{name} step {step}": p.grad.clone() for name, p in model.named_parameters()})
    return gradients


@pytest.mark.parametrize(
    ("tied", "switched"), [(True, ["head", "tied embedding"]), (False, ["head", "embedding"])], ids=["tied", "untied"]
)
def test_gradients_are_plain_autograds(tied: bool, switched: list[str]) -> None:
    ids = token_ids(6, seed=1)
    plain = gradients_of_two_steps(llama(tied), ids)
    model = llama(tied)
    assert accumulate_vocabulary_gradients_in_place(model) == switched
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    assert isinstance(head, InPlaceGradientHead)
    assert (head.weight is embedding.weight) == tied
    assert isinstance(embedding, InPlaceGradientEmbedding) != tied and embedding.sparse == tied
    assert type(model(input_ids=ids).logits.grad_fn).__name__ == "_HeadProductBackward"  # the fused path runs
    fused = gradients_of_two_steps(model, ids)
    assert fused.keys() == plain.keys()
    for name, gradient in fused.items():
        assert gradient.layout == torch.strided, name  # what clipping and the optimizer take
        torch.testing.assert_close(gradient, plain[name], rtol=1e-5, atol=1e-7, msg=name)
    if not tied:  # (tied, the padding row's logit still has a gradient)
        assert not fused["model.embed_tokens.weight step 0"][PAD].any()


def test_outputs_and_saved_model_are_unchanged(tmp_path: Path) -> None:
    ids = token_ids(2, seed=2)
    plain, fused = llama(tied=False), llama(tied=False)
    accumulate_vocabulary_gradients_in_place(fused)
    assert torch.equal(fused(input_ids=ids).logits, plain(input_ids=ids).logits)
    with torch.no_grad():
        assert torch.equal(fused(input_ids=ids).logits, plain(input_ids=ids).logits)
    plain.save_pretrained(tmp_path / "plain")
    fused.save_pretrained(tmp_path / "fused")
    reloaded = LlamaForCausalLM.from_pretrained(tmp_path / "fused")
    assert type(reloaded.get_output_embeddings()) is nn.Linear
    assert type(reloaded.get_input_embeddings()) is nn.Embedding
    assert reloaded.get_input_embeddings().padding_idx == PAD
    assert reloaded.state_dict().keys() == plain.state_dict().keys()
    for name, tensor in plain.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], tensor), name


def test_frozen_matrices_and_embeddings_with_options_are_left_alone() -> None:
    tied = llama(tied=True)
    freeze_all_but_top_layers(tied, 1)  # a tied head is frozen with the embedding
    head = tied.get_output_embeddings()
    assert accumulate_vocabulary_gradients_in_place(tied) == []
    assert tied.get_output_embeddings() is head and not tied.get_input_embeddings().sparse

    untied = llama(tied=False)
    untied.get_input_embeddings().max_norm = 1.0
    assert accumulate_vocabulary_gradients_in_place(untied) == ["head"]
    assert type(untied.get_input_embeddings()) is nn.Embedding


def test_calling_it_again_changes_nothing() -> None:
    for tied in (True, False):
        model = llama(tied)
        first = accumulate_vocabulary_gradients_in_place(model)
        modules = (model.get_output_embeddings(), model.get_input_embeddings())
        assert accumulate_vocabulary_gradients_in_place(model) == first
        assert (model.get_output_embeddings(), model.get_input_embeddings()) == modules


def test_under_autocast_autograd_keeps_the_gradients() -> None:
    """The in-place products need the weight's dtype; under autocast both modules are plain ones."""
    model = llama(tied=False)
    accumulate_vocabulary_gradients_in_place(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(input_ids=token_ids(2, seed=3)).logits
    assert logits.dtype == torch.bfloat16 and type(logits.grad_fn).__name__ != "_HeadProductBackward"
    logits.float().sum().backward()
    for matrix in (model.get_output_embeddings(), model.get_input_embeddings()):
        assert matrix.weight.grad is not None and matrix.weight.grad.dtype == torch.float32
