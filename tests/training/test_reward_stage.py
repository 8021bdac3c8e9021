"""The train-rm stage on the tiny model: it learns a planted preference, selects and saves the best model,
and its frozen-layer cache and batching options change no number."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest

from fixtures.tiny_ppo import tiny_config, write_prepared_data
from rlhf_core.config import Config
from rlhf_core.models.heads import RewardModel
from rlhf_core.models.loading import load_tokenizer
from rlhf_core.reward.length_metrics import AUC_GAIN_RESAMPLES, length_skill
from rlhf_core.reward.validation_table import VALIDATION_PAIRS_FILE
from rlhf_core.stages.reward import run_train_rm
from rlhf_core.stages.score_pairs import score_pair_file

pytestmark = pytest.mark.usefixtures("one_thread")

WORDS = (
    "river stone cloud paper green quiet table window music garden bright silver ocean winter candle "
    "forest yellow mirror pencil thunder"
).split()

MARKER = "banana"
# Behaviour runs: no SFT, the whole validation set at every validation, 16 steps of 8 pairs.
BEHAVIOUR = ("reward.init_from=base", "reward.max_steps=16", "reward.eval_every=8", "reward.eval_batches=100")


def uncapped_config(*overrides: str) -> Config:
    """The tiny config with every reward-model pair and SFT example of the data."""
    uncapped = ["data.max_rm_train_pairs=null", "data.max_rm_val_pairs=null", "data.max_sft_examples=null"]
    return tiny_config(*uncapped, *overrides)


def marker_rows(count: int, seed: int) -> list[dict[str, str]]:
    """HH pairs whose chosen reply holds the marker word among random words; the rejected one never does."""
    rng = random.Random(seed)
    rows = []
    for i in range(count):
        words = rng.sample(WORDS, 6)
        position = rng.randrange(len(words) + 1)
        chosen = " ".join(words[:position] + [MARKER] + words[position:])
        rejected = " ".join(rng.sample(WORDS, 7))
        prompt = f"\n\nHuman: Describe scene {i}, please."
        rows.append({"chosen": f"{prompt}\n\nAssistant: {chosen}", "rejected": f"{prompt}\n\nAssistant: {rejected}"})
    return rows


@pytest.fixture(scope="module")
def marker_data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Not the shared `data_dir`: 300 pairs with the planted marker, every one kept (the preference to learn)."""
    return write_prepared_data(tmp_path_factory.mktemp("marker-data"), marker_rows(300, seed=0), uncapped_config())


@pytest.fixture(scope="module")
def behaviour_run(marker_data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, float]]:
    out = tmp_path_factory.mktemp("rm-run") / "reward"
    result = run_train_rm(uncapped_config(*BEHAVIOUR), marker_data_dir, None, out)
    assert result.model_dir == out / "model"
    return out, result.metrics


def test_reward_model_learns_that_the_marker_word_is_preferred(behaviour_run: tuple[Path, dict[str, float]]) -> None:
    out, metrics = behaviour_run
    history = [json.loads(line) for line in (out / "history.jsonl").read_text().splitlines()]
    assert history[0]["accuracy"] <= 0.5  # the untrained model (step 1's forward pass) prefers neither
    assert metrics["val/accuracy"] >= 0.95 and metrics["val/pairs"] >= 60
    assert metrics["val/accuracy_low"] <= metrics["val/accuracy"] <= metrics["val/accuracy_high"]
    assert metrics["val/margin_mean"] > 0


def test_outputs_follow_the_stage_contract(behaviour_run: tuple[Path, dict[str, float]]) -> None:
    out, metrics = behaviour_run
    assert json.loads((out / "metrics.json").read_text()) == pytest.approx(metrics)
    assert (out / "plots" / "reward_margin_hist.png").read_bytes()[:4] == b"\x89PNG"
    history = [json.loads(line) for line in (out / "history.jsonl").read_text().splitlines()]
    assert [row["step"] for row in history] == list(range(1, 17))
    assert history[-1]["progress"] == 1.0 and all(0 < row["progress"] <= 1 for row in history)
    validated = {row["step"]: row["val/accuracy"] for row in history if "val/accuracy" in row}
    assert set(validated) == {8, 16}
    best_step = int(metrics["best_step"])
    assert validated[best_step] == max(validated.values()) and metrics["steps"] == 16
    assert {p.name for p in (out / "checkpoints").iterdir()} >= {"step-00000016"}


def test_validation_pairs_table_holds_each_pair_with_both_scores(behaviour_run: tuple[Path, dict[str, float]]) -> None:
    out, metrics = behaviour_run
    rows = [json.loads(line) for line in (out / VALIDATION_PAIRS_FILE).read_text().splitlines()]
    assert len(rows) == metrics["val/pairs"]
    assert all(MARKER in row["chosen"] and MARKER not in row["rejected"] for row in rows)
    assert all(row["margin"] == pytest.approx(row["score_chosen"] - row["score_rejected"]) for row in rows)
    assert sum(row["margin"] for row in rows) / len(rows) == pytest.approx(metrics["val/margin_mean"], abs=1e-5)
    assert sum(row["margin"] > 0 for row in rows) / len(rows) == pytest.approx(metrics["val/accuracy"])
    assert len({(row["source"], row["line"]) for row in rows}) == len(rows)  # each pair once, findable


def test_skill_beyond_length_is_measured_on_the_table_of_validation_pairs(
    behaviour_run: tuple[Path, dict[str, float]],
) -> None:
    out, metrics = behaviour_run
    rows = [json.loads(line) for line in (out / VALIDATION_PAIRS_FILE).read_text().splitlines()]
    tokenizer = load_tokenizer(out / "model")
    for row in rows:  # the reply alone, in the reward model's tokens
        assert row["tokens_chosen"] == len(tokenizer(row["chosen"], add_special_tokens=False)["input_ids"])
        assert row["tokens_rejected"] == len(tokenizer(row["rejected"], add_special_tokens=False)["input_ids"])
    names = ("score_chosen", "score_rejected", "tokens_chosen", "tokens_rejected")
    columns = [np.array([row[name] for row in rows]) for name in names]
    expected = length_skill(*columns, resamples=AUC_GAIN_RESAMPLES, seed=uncapped_config().seed)
    figures = {name: value for name, value in metrics.items() if name.removeprefix("val/") in expected.figures()}
    assert figures == pytest.approx(expected.figures("val/"), abs=1e-6)
    assert {"val/length_rule_accuracy", "val/length_matched_pairs", "val/auc_gain_over_length_low"} <= set(figures)
    history = [json.loads(line) for line in (out / "history.jsonl").read_text().splitlines()]
    validated = [row for row in history if "val/accuracy" in row]
    # Periodic validations measure the cheap figures, without the AUC gain's bootstrap.
    assert all("val/length_rule_accuracy" in row and "val/auc_gain_over_length_low" not in row for row in validated)


def test_score_pairs_reports_each_scored_batch_to_its_progress_callback(
    behaviour_run: tuple[Path, dict[str, float]], marker_data_dir: Path
) -> None:
    out, _ = behaviour_run
    reported: list[tuple[int, int]] = []
    result = score_pair_file(
        uncapped_config("reward.micro_batch_size=16"),
        out,
        str(marker_data_dir / "rm_val.parquet"),
        on_progress=lambda done, total: reported.append((done, total)),
    )
    pairs = result.accuracy.pairs
    assert reported[-1] == (pairs, pairs)
    assert [done for done, _ in reported] == [min(16 * batch, pairs) for batch in range(1, len(reported) + 1)]
    assert len(reported) == -(-pairs // 16) > 1


def test_saved_model_is_the_best_and_reproduces_the_metrics(
    behaviour_run: tuple[Path, dict[str, float]], marker_data_dir: Path
) -> None:
    out, metrics = behaviour_run
    model = RewardModel.from_pretrained(out / "model")
    assert model.lm_head is not None  # beta_rm = 1 keeps the LM head; PPO loads this directory
    rescored = score_pair_file(uncapped_config(), out, str(marker_data_dir / "rm_val.parquet"))
    assert rescored.accuracy.accuracy == pytest.approx(metrics["val/accuracy"])
    assert rescored.accuracy.mean_margin == pytest.approx(metrics["val/margin_mean"], abs=1e-5)
    # The same pairs in another order: the figures that do not resample agree.
    rescored_figures = rescored.length.figures()
    for name in ("length_rule_accuracy", "length_matched_pairs", "length_matched_accuracy", "reward_length_spearman"):
        assert rescored_figures[name] == pytest.approx(metrics[f"val/{name}"], abs=1e-5), name
    assert rescored.length.auc.gain == pytest.approx(metrics["val/auc_gain_over_length"], abs=1e-3)


def test_frozen_layer_cache_changes_no_number(marker_data_dir: Path, tmp_path: Path) -> None:
    """The same training with the lower block cached and computed every time: same metrics, same model."""
    settings = ("reward.init_from=base", "reward.max_steps=4", "reward.trainable_top_layers=1")
    cached = run_train_rm(uncapped_config(*settings), marker_data_dir, None, tmp_path / "cached").metrics
    plain = run_train_rm(
        uncapped_config(*settings, "reward.cache_frozen_layers=false"), marker_data_dir, None, tmp_path / "plain"
    )
    for name in ("val/accuracy", "val/margin_mean", "val/ranking_loss", "val/lm_loss", "train_loss", "best_step"):
        assert cached[name] == pytest.approx(plain.metrics[name], rel=1e-5, abs=1e-6), name
    # Weights: the two runs multiply matrices of other shapes (float rounding), and Adam turns a rounding-level
    # change of a near-zero gradient into up to a learning rate (1e-3) of update. So: every element within a
    # tenth of one step, and the mean difference at rounding level (a wrong cache moves every element).
    ours = RewardModel.from_pretrained(tmp_path / "cached" / "model").state_dict()
    for name, tensor in RewardModel.from_pretrained(tmp_path / "plain" / "model").state_dict().items():
        difference = (ours[name] - tensor).abs()
        assert float(difference.max()) < 1e-4 and float(difference.mean()) < 1e-7, name


@pytest.mark.parametrize("batching", ["token_budget", "length_grouped"])
def test_other_batchings_train(batching: str, marker_data_dir: Path, tmp_path: Path) -> None:
    config = uncapped_config(
        "reward.init_from=base", "reward.max_steps=3", f"reward.batching={batching}", "reward.token_budget=1200"
    )
    metrics = run_train_rm(config, marker_data_dir, None, tmp_path / "rm").metrics
    assert metrics["steps"] == 3
    history = [json.loads(line) for line in (tmp_path / "rm" / "history.jsonl").read_text().splitlines()]
    assert [row["step"] for row in history] == [1, 2, 3]


def test_init_from_sft_needs_a_finished_sft_stage(marker_data_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "sft" / "model").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match="not a completed stage output"):
        run_train_rm(uncapped_config(), marker_data_dir, tmp_path / "sft", tmp_path / "rm")
