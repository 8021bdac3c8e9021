"""`reward.length_debias`: the pieces against plain references, ODIN on synthetic data where quality and
length are separable, and each mode through the train-rm stage on the tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from transformers import AutoTokenizer

from fixtures.tiny_ppo import tiny_config
from rlhf_core.data.prepare import load_split
from rlhf_core.models.heads import RewardModel
from rlhf_core.reward.length_debias import (
    BALANCE_BINS,
    LENGTH_TERM_GAIN,
    LengthTerm,
    OdinLengthHead,
    length_balanced_indices,
    logit_scores,
    odin_penalty,
    pearson,
)
from rlhf_core.reward.scoring import PairOutputs, SideOutputs, score_pair_batches
from rlhf_core.stages.prepare_data import run_prepare_data
from rlhf_core.stages.reward import encode_reward_pairs, run_train_rm, scored_reply_tokens, validation_batches
from rlhf_core.statistics import length_slope


def test_pearson_matches_numpy_and_is_zero_for_a_constant() -> None:
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=50), rng.normal(size=50) + np.arange(50) / 20
    expected = np.corrcoef(x, y)[0, 1]
    assert pearson(torch.tensor(x), torch.tensor(y)).item() == pytest.approx(expected, abs=1e-9)
    assert pearson(torch.tensor(x), torch.ones(50, dtype=torch.float64)).item() == 0.0


def test_length_slope_is_the_least_squares_slope_on_log_length() -> None:
    rng = np.random.default_rng(1)
    tokens = rng.integers(1, 200, size=300)
    scores = 0.3 - 0.7 * np.log1p(tokens) + rng.normal(scale=0.5, size=300)
    assert length_slope(scores, tokens) == pytest.approx(np.polyfit(np.log1p(tokens), scores, 1)[0], abs=1e-12)
    residual = scores - length_slope(scores, tokens) * np.log1p(tokens)
    assert abs(np.corrcoef(residual, np.log1p(tokens))[0, 1]) < 1e-12
    assert length_slope(scores, np.full(300, 17)) == 0.0  # no spread in length: no slope to fit


def reference_balanced_counts(chosen: np.ndarray, rejected: np.ndarray) -> dict[int, tuple[int, int]]:
    """Per quantile bin of |dlen| (as the code bins it): (chosen longer, chosen shorter) counts after balancing."""
    difference = chosen - rejected
    magnitude = np.abs(difference[difference != 0])
    edges = np.quantile(magnitude, np.linspace(0, 1, BALANCE_BINS + 1)[1:-1])
    counts = {}
    for bin_index in range(BALANCE_BINS):
        longer = shorter = 0
        for d in difference:
            if d != 0 and int(np.searchsorted(edges, abs(d), side="right")) == bin_index:
                longer += d > 0
                shorter += d < 0
        counts[bin_index] = (min(longer, shorter), min(longer, shorter))
    return counts


def test_balanced_indices_equalise_the_labels_in_every_bin_of_length_difference() -> None:
    rng = np.random.default_rng(1)
    rejected = rng.integers(5, 80, size=400)
    # Chosen shorter in about 70% of the pairs, some pairs of equal length.
    chosen = np.where(
        rng.random(400) < 0.7, rejected - rng.integers(0, 30, size=400), rejected + rng.integers(1, 30, size=400)
    )
    keep = length_balanced_indices(chosen.tolist(), rejected.tolist(), seed=3)
    assert keep == sorted(set(keep))
    difference = chosen - rejected
    kept = np.zeros(400, dtype=bool)
    kept[keep] = True
    assert kept[difference == 0].all()  # equal lengths carry no length signal: all kept
    assert (difference[kept] > 0).sum() == (difference[kept] < 0).sum()
    magnitude = np.abs(difference[difference != 0])
    edges = np.quantile(magnitude, np.linspace(0, 1, BALANCE_BINS + 1)[1:-1])
    for bin_index, (longer, shorter) in reference_balanced_counts(chosen, rejected).items():
        in_bin = kept & (difference != 0) & (np.searchsorted(edges, np.abs(difference), side="right") == bin_index)
        assert ((difference[in_bin] > 0).sum(), (difference[in_bin] < 0).sum()) == (longer, shorter)
    assert length_balanced_indices(chosen.tolist(), rejected.tolist(), seed=3) == keep  # seeded


def test_a_length_head_adds_to_the_ranking_logit_and_the_length_term_starts_at_zero() -> None:
    side = SideOutputs(torch.tensor([1.0, 2.0]), torch.tensor([3, 4]), torch.tensor([0.5, -0.5]))
    assert logit_scores(side).tolist() == [1.5, 1.5]
    term = LengthTerm()
    assert term(torch.zeros(2, 8), torch.tensor([3, 40])).tolist() == [0.0, 0.0]
    with torch.no_grad():
        term.scaled_weight.fill_(2.0 / LENGTH_TERM_GAIN)
    assert term(torch.zeros(2, 8), torch.tensor([3, 40])).tolist() == pytest.approx([2 * np.log(4), 2 * np.log(41)])


def synthetic_pairs(count: int, hidden: int, seed: int) -> tuple[torch.Tensor, ...]:
    """Pairs of replies as hidden features: quality on dimension 0, length (tokens) shown on dimension 1, noise
    elsewhere. The label follows quality plus a strong pull towards the SHORTER reply (as in the harmless
    data), so a plain reward model learns length too."""
    generator = torch.Generator().manual_seed(seed)
    quality = torch.randn(count, 2, generator=generator)
    lengths = torch.randint(5, 120, (count, 2), generator=generator)
    features = torch.randn(count, 2, hidden, generator=generator) * 0.3
    features[..., 0] = quality
    features[..., 1] = (lengths.float() - 60) / 35
    utility = quality - (lengths.float() - 60) / 25
    swap = utility[:, 1] > utility[:, 0]  # put the chosen reply (higher utility) in column 0

    def chosen_first(x: torch.Tensor) -> torch.Tensor:
        return torch.where(swap.view(-1, *[1] * (x.dim() - 1)), x.flip(1), x)

    return chosen_first(features), chosen_first(lengths), chosen_first(quality)


def train_heads(odin: bool, features: torch.Tensor, lengths: torch.Tensor, seed: int) -> nn.Linear:
    """Train a quality head (and, with `odin`, a length head and ODIN's terms) on the synthetic pairs."""
    torch.manual_seed(seed)
    hidden = features.shape[-1]
    quality_head = nn.Linear(hidden, 1)
    length_head = OdinLengthHead(hidden, seed, torch.float32, torch.device("cpu")) if odin else None
    parameters = list(quality_head.parameters()) + (list(length_head.parameters()) if odin else [])
    optimizer = torch.optim.Adam(parameters, lr=0.02)
    steps = 600
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / steps)  # settles |rho|'s kink
    for step in range(steps):
        batch = torch.randint(0, features.shape[0], (64,), generator=torch.Generator().manual_seed(step))
        sides = []
        for column in (0, 1):
            end_hidden, side_lengths = features[batch, column], lengths[batch, column]
            length_scores = length_head(end_hidden, side_lengths) if odin else None
            sides.append(SideOutputs(quality_head(end_hidden).squeeze(-1), side_lengths, length_scores))
        outputs = PairOutputs(chosen=sides[0], rejected=sides[1], lm_nll_sum=None)
        loss = -F.logsigmoid(logit_scores(outputs.chosen) - logit_scores(outputs.rejected)).mean()
        if odin:
            loss = loss + odin_penalty(outputs, quality_head.weight, length_head.weight, 1.0, 1.0)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
    return quality_head


def test_odin_quality_head_loses_its_length_correlation_and_keeps_quality() -> None:
    features, lengths, quality = synthetic_pairs(3000, hidden=8, seed=0)
    scored = {}
    for odin in (False, True):
        head = train_heads(odin, features, lengths, seed=0)
        with torch.no_grad():
            scores = head(features).squeeze(-1)  # [P, 2]
        length_corr = pearson(scores.flatten(), lengths.flatten().float()).item()
        quality_accuracy = ((scores[:, 0] > scores[:, 1]) == (quality[:, 0] > quality[:, 1])).float().mean().item()
        scored[odin] = (length_corr, quality_accuracy)
    plain_corr, plain_quality = scored[False]
    odin_corr, odin_quality = scored[True]
    assert plain_corr < -0.4  # the plain head pays for brevity
    assert abs(odin_corr) < 0.1 and abs(odin_corr) < abs(plain_corr) / 8  # ODIN's quality head does not
    assert odin_quality > 0.95 and odin_quality > plain_quality  # and ranks by quality


@pytest.fixture(scope="module")
def length_confounded_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Marker-word pairs whose chosen reply is also the shorter one in 3 pairs of 4."""
    rows = []
    for i in range(160):
        words = ["river", "stone", "cloud", "paper", "green", "quiet", "table", "window", "music", "garden"]
        short, long = " ".join(words[: 3 + i % 3]), " ".join(words[: 7 + i % 3])
        chosen, rejected = (f"banana {short}", long) if i % 4 else (f"banana {long}", short)
        prompt = f"\n\nHuman: Describe scene {i}, please."
        rows.append({"chosen": f"{prompt}\n\nAssistant: {chosen}", "rejected": f"{prompt}\n\nAssistant: {rejected}"})
    root = tmp_path_factory.mktemp("length-confounded")
    (root / "pairs.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    run_prepare_data(tiny_config("data.max_rm_train_pairs=null"), root / "prepared", str(root / "pairs.jsonl"))
    return root / "prepared"


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["balanced", "length_term", "odin"])
def test_every_mode_trains_and_saves_the_quality_head_alone(
    length_confounded_data: Path, tmp_path: Path, mode: str
) -> None:
    config = tiny_config(
        "data.max_rm_train_pairs=null", "reward.init_from=base", "reward.max_steps=3", f"reward.length_debias={mode}"
    )
    result = run_train_rm(config, length_confounded_data, None, tmp_path / "rm")
    history = [json.loads(line) for line in (tmp_path / "rm" / "history.jsonl").read_text().splitlines()]
    assert ("odin_penalty" in history[0]) == (mode == "odin")
    reloaded = RewardModel.from_pretrained(tmp_path / "rm" / "model")
    assert reloaded.length_head is None  # PPO and the judge read the quality head alone
    if mode == "balanced":
        unbalanced = run_train_rm(
            tiny_config("data.max_rm_train_pairs=null", "reward.init_from=base", "reward.max_steps=1"),
            length_confounded_data,
            None,
            tmp_path / "plain",
        )
        assert result.metrics["train_pairs"] < unbalanced.metrics["train_pairs"]


@pytest.mark.slow
def test_length_residual_saves_a_reward_uncorrelated_with_length_on_the_training_replies(
    length_confounded_data: Path, tmp_path: Path
) -> None:
    settings = ("data.max_rm_train_pairs=null", "reward.init_from=base", "reward.max_steps=3")
    config = tiny_config(*settings, "reward.length_debias=length_residual")
    result = run_train_rm(config, length_confounded_data, None, tmp_path / "rm")
    model = RewardModel.from_pretrained(tmp_path / "rm" / "model")
    assert model.length_slope == result.metrics["length_slope"] != 0.0

    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "rm" / "model")
    records = load_split(length_confounded_data, "rm_train"), load_split(length_confounded_data, "rm_val")
    train_pairs, _ = encode_reward_pairs(tokenizer, *records, config.reward, length_confounded_data, "rm_train", 0)
    batches = validation_batches(train_pairs, 4, 0, tokenizer.pad_token_id)
    log_length = np.log1p(np.concatenate(scored_reply_tokens(train_pairs, batches)))

    def scores() -> np.ndarray:
        scored = score_pair_batches(model, batches, None, with_lm_loss=False)
        return np.concatenate([scored.chosen, scored.rejected])

    debiased = scores()
    model.length_slope = 0.0
    head = scores()
    assert debiased == pytest.approx(head - result.metrics["length_slope"] * log_length, abs=1e-5)
    assert abs(np.corrcoef(debiased, log_length)[0, 1]) < 1e-3  # what PPO reads pays nothing for length
    assert abs(np.corrcoef(head, log_length)[0, 1]) > 0.1  # the head alone did

    plain = run_train_rm(tiny_config(*settings), length_confounded_data, None, tmp_path / "plain")
    assert result.metrics["val/auc_gain_over_length"] == pytest.approx(
        plain.metrics["val/auc_gain_over_length"], abs=1e-3
    )
