"""The training loop: micro-batch invariance of the update, NaN stop, optimizer groups, validation and
best-metric tracking, logged lr and grad norm, and a rerun of a finished run."""

import json
import math
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn

from fixtures.parameters import SMALL_LLAMA, small_llama
from rlhf_core.training.batching import BatchPlan, fixed_size_plan, token_budget_plan
from rlhf_core.training.logger import JsonlLogger
from rlhf_core.training.loop import NonFiniteLossError, build_optimizer, total_steps, train
from rlhf_core.training.loop_config import LoopConfig
from rlhf_core.training.schedules import warmup_cosine

VOCAB = SMALL_LLAMA["vocab_size"]
PAD = -100
LENGTHS = [3, 5, 9, 14]  # different lengths: per-micro-batch averaging would weight tokens unequally


def random_sequences(lengths: list[int], seed: int) -> list[Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=generator) for n in lengths]


def pad_batch(sequences: list[Tensor]) -> dict[str, Tensor]:
    """Right-padded ids, attention mask and next-token labels (PAD where there is no target)."""
    width = max(len(s) for s in sequences)
    ids = torch.zeros(len(sequences), width, dtype=torch.long)
    mask = torch.zeros(len(sequences), width, dtype=torch.long)
    labels = torch.full((len(sequences), width), PAD)
    for row, sequence in enumerate(sequences):
        ids[row, : len(sequence)] = sequence
        mask[row, : len(sequence)] = 1
        labels[row, : len(sequence) - 1] = sequence[1:]
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def token_count(batch: dict[str, Tensor]) -> dict[str, int]:
    return {"tokens": int((batch["labels"] != PAD).sum())}


def summed_nll(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="sum")


def sft_loss(model: nn.Module, batch: dict[str, Tensor], totals: dict[str, int]) -> tuple[Tensor, dict[str, float]]:
    loss = summed_nll(model, batch) / totals["tokens"]
    return loss, {"nll": loss.item()}


def flat_parameters(model: nn.Module) -> Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def one_step_config(**overrides: object) -> LoopConfig:
    settings = {"max_steps": 1, "lr": 1e-3, "max_grad_norm": None, "progress_bar": False, **overrides}
    return LoopConfig(**settings)


def train_one_step(plan: BatchPlan, loss_fn, sequences: list[Tensor]) -> tuple[Tensor, dict[str, float]]:
    model = small_llama()
    collate = lambda indices: pad_batch([sequences[i] for i in indices])  # noqa: E731
    result = train(model, plan, collate, token_count, loss_fn, one_step_config())
    return flat_parameters(model), result.metrics


def test_micro_batch_1_times_4_equals_micro_batch_4_times_1_with_token_normalised_loss() -> None:
    sequences = random_sequences(LENGTHS, seed=1)
    accumulated, metrics_accumulated = train_one_step(fixed_size_plan(4, 0, 1, 4), sft_loss, sequences)
    single, metrics_single = train_one_step(fixed_size_plan(4, 0, 4, 1), sft_loss, sequences)
    assert (accumulated - single).abs().max().item() <= 1e-6
    # The loss and loss_fn metrics are summed over micro-batches: the step's token mean either way.
    assert metrics_accumulated["loss"] == pytest.approx(metrics_single["loss"], abs=1e-6)
    assert metrics_accumulated["nll"] == pytest.approx(metrics_single["nll"], abs=1e-6)

    def naive_loss(model: nn.Module, batch: dict[str, Tensor], totals: dict[str, int]) -> tuple[Tensor, dict]:
        """Mean over the micro-batch's own tokens, averaged over the 4 micro-batches: the classic mistake."""
        return summed_nll(model, batch) / token_count(batch)["tokens"] / 4, {}

    naive, _ = train_one_step(fixed_size_plan(4, 0, 1, 4), naive_loss, sequences)
    assert (accumulated - naive).abs().max().item() > 1e-4


class TinyRewardModel(nn.Module):
    """A tiny Llama with a scalar head on the last real token: reward plus LM logits."""

    def __init__(self) -> None:
        super().__init__()
        self.lm = small_llama()
        self.head = nn.Linear(32, 1)

    def forward(self, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        output = self.lm(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], output_hidden_states=True
        )
        last = batch["attention_mask"].sum(dim=1) - 1
        hidden = output.hidden_states[-1][torch.arange(len(last)), last]
        return self.head(hidden).squeeze(-1), output.logits


def test_reward_loss_over_pairs_and_tokens_is_invariant_to_dynamic_batching() -> None:
    """Paper eq. 2 + beta * LM loss: ranking loss per pair over all pairs, LM loss per chosen token."""
    chosen = random_sequences([4, 12, 6, 3, 9, 7], seed=2)
    rejected = random_sequences([5, 3, 10, 8, 4, 6], seed=3)
    beta = 0.5

    def collate(indices: list[int]) -> dict[str, dict[str, Tensor]]:
        return {
            "chosen": pad_batch([chosen[i] for i in indices]),
            "rejected": pad_batch([rejected[i] for i in indices]),
        }

    def count_units(batch: dict[str, dict[str, Tensor]]) -> dict[str, int]:
        return {"pairs": len(batch["chosen"]["input_ids"]), "tokens": token_count(batch["chosen"])["tokens"]}

    def rm_loss(model: nn.Module, batch: dict, totals: dict[str, int]) -> tuple[Tensor, dict[str, float]]:
        reward_chosen, logits = model(batch["chosen"])
        reward_rejected, _ = model(batch["rejected"])
        ranking = -nn.functional.logsigmoid(reward_chosen - reward_rejected).sum() / totals["pairs"]
        labels = batch["chosen"]["labels"]
        token_nll = nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
        lm = token_nll / totals["tokens"]
        accuracy = (reward_chosen > reward_rejected).sum().item() / totals["pairs"]
        return ranking + beta * lm, {"accuracy": accuracy}

    lengths = [max(len(c), len(r)) for c, r in zip(chosen, rejected)]
    dynamic = token_budget_plan(lengths, seed=0, token_budget=20, accumulation_steps=1)
    micro_batches = [list(batch) for batch in dynamic.packed_micro_batches]
    assert len(micro_batches) >= 3 and len({len(b) for b in micro_batches}) > 1
    dynamic = token_budget_plan(lengths, seed=0, token_budget=20, accumulation_steps=len(micro_batches))
    whole = BatchPlan(num_examples=6, seed=0, accumulation_steps=1, packed_micro_batches=(tuple(range(6)),))

    parameters, metrics = [], []
    for plan in (dynamic, whole):
        model = TinyRewardModel()
        result = train(model, plan, collate, count_units, rm_loss, one_step_config())
        parameters.append(flat_parameters(model))
        metrics.append(result.metrics)
    assert (parameters[0] - parameters[1]).abs().max().item() <= 1e-6
    assert metrics[0]["loss"] == pytest.approx(metrics[1]["loss"], abs=1e-6)
    assert metrics[0]["accuracy"] == pytest.approx(metrics[1]["accuracy"], abs=1e-9)


def test_nan_loss_at_step_3_raises_naming_step_3_before_the_optimizer_steps() -> None:
    sequences = random_sequences([4] * 8, seed=4)
    model = small_llama()
    calls = {"count": 0}
    weights_before_step_3: list[Tensor] = []

    def loss_fn(model: nn.Module, batch: dict[str, Tensor], totals: dict[str, int]) -> tuple[Tensor, dict]:
        calls["count"] += 1
        loss, metrics = sft_loss(model, batch, totals)
        if calls["count"] == 3:  # one micro-batch per step: call 3 is step 3
            weights_before_step_3.append(flat_parameters(model))
            loss = loss * float("nan")
        return loss, metrics

    plan = fixed_size_plan(8, seed=0, micro_batch_size=2, accumulation_steps=1)
    config = LoopConfig(max_steps=4, lr=1e-2, progress_bar=False)
    collate = lambda indices: pad_batch([sequences[i] for i in indices])  # noqa: E731
    expected = r"loss of micro-batch 0 is nan at optimizer step 3\b"
    with pytest.raises(NonFiniteLossError, match=expected) as error:
        train(model, plan, collate, token_count, loss_fn, config)
    assert error.value.step == 3 and math.isnan(error.value.value)
    assert torch.equal(flat_parameters(model), weights_before_step_3[0])


def test_non_finite_gradient_with_a_finite_loss_also_stops_before_the_optimizer_step() -> None:
    sequences = random_sequences([4] * 4, seed=4)
    model = small_llama()
    weights_before = flat_parameters(model)

    def loss_fn(model: nn.Module, batch: dict[str, Tensor], totals: dict[str, int]) -> tuple[Tensor, dict]:
        loss, metrics = sft_loss(model, batch, totals)
        # sqrt at 0 has an infinite slope: the value stays finite (0) but the gradient is nan.
        return loss + torch.sqrt(model.lm_head.weight[0, 0] * 0.0), metrics

    plan = fixed_size_plan(4, seed=0, micro_batch_size=2, accumulation_steps=1)
    collate = lambda indices: pad_batch([sequences[i] for i in indices])  # noqa: E731
    with pytest.raises(NonFiniteLossError, match=r"gradient norm is nan at optimizer step 1\b"):
        train(model, plan, collate, token_count, loss_fn, one_step_config())
    assert torch.equal(flat_parameters(model), weights_before)


def test_optimizer_skips_frozen_parameters_and_decays_only_matrices() -> None:
    model = small_llama()
    model.model.embed_tokens.requires_grad_(False)
    optimizer = build_optimizer(model, LoopConfig(lr=1e-3, weight_decay=0.1))
    decayed, undecayed = optimizer.param_groups
    assert decayed["weight_decay"] == 0.1 and undecayed["weight_decay"] == 0.0
    names = {id(p): name for name, p in model.named_parameters()}
    decayed_names = {names[id(p)] for p in decayed["params"]}
    undecayed_names = {names[id(p)] for p in undecayed["params"]}
    assert "model.embed_tokens.weight" not in decayed_names | undecayed_names
    assert "lm_head.weight" in decayed_names and "model.layers.0.mlp.up_proj.weight" in decayed_names
    assert undecayed_names == {name for name, p in model.named_parameters() if p.ndim == 1}
    assert "model.norm.weight" in undecayed_names


def test_total_steps_from_fractional_epochs_capped_by_max_steps() -> None:
    plan = fixed_size_plan(20, seed=0, micro_batch_size=2, accumulation_steps=2)  # 5 steps per epoch
    assert total_steps(LoopConfig(lr=1e-3, epochs=1.5), plan) == 8  # ceil(7.5)
    assert total_steps(LoopConfig(lr=1e-3, epochs=3, max_steps=11), plan) == 11
    with pytest.raises(ValueError):
        LoopConfig(lr=1e-3, schedule="linear")


def test_validation_cadence_best_tracking_logged_lr_and_grad_norm(tmp_path: Path) -> None:
    sequences = random_sequences([3, 4, 5, 6, 7, 8, 9, 10], seed=5)
    scores = iter([0.5, 0.7, 0.6, 0.9])  # periodic at steps 2, 4, 6, then the full one after step 7
    evaluate_calls: list[int | None] = []
    best_calls: list[tuple[int, float]] = []

    def evaluate(model: nn.Module, max_batches: int | None) -> dict[str, float]:
        assert not model.training and not torch.is_grad_enabled()
        evaluate_calls.append(max_batches)
        return {"val/accuracy": next(scores)}

    config = LoopConfig(
        max_steps=7,
        epochs=10,
        lr=1e-2,
        warmup_ratio=0.3,
        min_lr_ratio=0.1,
        max_grad_norm=0.5,
        eval_every=2,
        eval_batches=3,
        progress_bar=False,
    )
    logger = JsonlLogger(tmp_path / "history.jsonl")
    result = train(
        small_llama(),
        fixed_size_plan(8, seed=0, micro_batch_size=2, accumulation_steps=2),
        lambda indices: pad_batch([sequences[i] for i in indices]),
        token_count,
        sft_loss,
        config,
        evaluate=evaluate,
        select_best=("val/accuracy", "max"),
        on_best=lambda model, step, metrics: best_calls.append((step, metrics["val/accuracy"])),
        logger=logger,
    )
    logger.close()
    assert evaluate_calls == [3, 3, 3, None]
    assert best_calls == [(2, 0.5), (4, 0.7), (7, 0.9)]
    assert result.best_metric == 0.9 and result.final_step == 7 and result.resumed_from == 0
    history = [json.loads(line) for line in (tmp_path / "history.jsonl").read_text().splitlines()]
    assert [row["step"] for row in history] == list(range(1, 8))
    assert [row["step"] for row in history if "val/accuracy" in row] == [2, 4, 6, 7]
    warmup_steps = round(0.3 * 7)
    for row in history:
        assert row["lr"] == pytest.approx(1e-2 * warmup_cosine(row["step"] - 1, 7, warmup_steps, 0.1))
        assert row["epoch"] == pytest.approx(row["step"] / 2)
        assert row["grad_norm"] > 0.5  # the norm is logged before clipping


def test_logged_grad_norm_is_the_norm_of_the_full_step_gradient() -> None:
    sequences = random_sequences(LENGTHS, seed=6)
    reference = small_llama()
    batch = pad_batch(sequences)
    (summed_nll(reference, batch) / token_count(batch)["tokens"]).backward()
    expected = torch.cat([p.grad.flatten() for p in reference.parameters()]).norm().item()
    _, metrics = train_one_step(fixed_size_plan(4, 0, 2, 2), sft_loss, sequences)
    assert metrics["grad_norm"] == pytest.approx(expected, rel=1e-5)


def test_rerun_of_a_finished_run_restores_its_result_and_trains_nothing(tmp_path: Path) -> None:
    sequences = random_sequences([3, 4, 5, 6, 7, 8], seed=7)
    collate = lambda indices: pad_batch([sequences[i] for i in indices])  # noqa: E731
    plan = fixed_size_plan(6, seed=0, micro_batch_size=2, accumulation_steps=1)
    config = LoopConfig(epochs=2, max_steps=5, lr=1e-2, checkpoint_every=2, keep_checkpoints=2, progress_bar=False)
    model = small_llama()
    first = train(model, plan, collate, token_count, sft_loss, config, checkpoint_dir=tmp_path / "ckpt")
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step-00000004", "step-00000005"]

    def must_not_train(*args: object) -> tuple[Tensor, dict]:
        raise AssertionError("a finished run trained again")

    rerun_model = small_llama(seed=1)
    second = train(rerun_model, plan, collate, token_count, must_not_train, config, checkpoint_dir=tmp_path / "ckpt")
    assert second.resumed_from == 5 and second.final_step == 5
    assert second.metrics == first.metrics
    assert torch.equal(flat_parameters(rerun_model), flat_parameters(model))
