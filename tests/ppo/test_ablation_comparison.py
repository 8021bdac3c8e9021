"""The ablation's comparison is read from each variant's own files and says what they say: the table's
numbers are those of the variants' metrics.json, the figures are written, the findings name the
variant the guard stopped and the one whose reward rose while the judge preferred SFT."""

from __future__ import annotations

import json
from pathlib import Path

from rlhf_core.ablation.comparison import VariantFiles, read_variant
from rlhf_core.ablation.report import COMPARISON_MD, MONITORS_PNG, OUTCOMES_PNG, flat_rows, read_rows, write_report
from rlhf_core.ablation.summary import signed_interval

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
GUARD_MESSAGE = (
    "collapse guard stopped the run at step 5: per-token KL to the reference 0.7 > max_kl 0.5 [bound: max_kl]"
)


def write_ppo_output(directory: Path, kl_per_step: float, reward_per_step: float, steps: int, stop: bool) -> dict:
    """A PPO stage output as run_ppo leaves it: history.jsonl, metrics.json (and guard_stop.txt)."""
    directory.mkdir(parents=True)
    history = [{"step": 0, "val/reward": 0.0, "val/kl": 0.0}]
    history += [
        {
            "step": step,
            "reward/score_mean": reward_per_step * step,
            "kl/token_k3": kl_per_step * step,
            "perplexity/policy": 10.0 - step,
            "response/length_mean": 20.0 + 2 * step,
            "policy/updating": float(step > 1),
        }
        for step in range(1, steps + 1)
    ]
    (directory / "history.jsonl").write_text("".join(json.dumps(row) + "\n" for row in history))
    metrics = {
        "steps_completed": float(steps), "total_steps": 8.0, "best_step": 4.0, "val/kl_best": 0.05,
        "val/reward_gain": 0.2 * kl_per_step, "val/reward_gain_low": 0.1 * kl_per_step, "val/reward_gain_high": 0.3,
        "guard_stopped": float(stop), "resumed_from": 0.0, "wall_time_s": 90.0 * steps,
        "first/kl/token_k3": kl_per_step, "last/kl/token_k3": kl_per_step * steps,
        "first/reward/score_mean": reward_per_step, "last/reward/score_mean": reward_per_step * steps,
    }  # fmt: skip
    if stop:
        metrics["guard_stop_step"] = float(steps)
        (directory / "guard_stop.txt").write_text(GUARD_MESSAGE + "\n")
    (directory / "metrics.json").write_text(json.dumps(metrics))
    return metrics


def write_eval_output(directory: Path, win_minus_loss: float, lc_win_rate: float) -> dict:
    directory.mkdir(parents=True)
    metrics = {
        "win_minus_loss": win_minus_loss, "win_minus_loss_low": win_minus_loss - 0.1,
        "win_minus_loss_high": win_minus_loss + 0.1, "score_diff_mean": -0.5, "score_diff_low": -0.7,
        "score_diff_high": -0.3, "judge_in_sample": 0.0, "wall_time_s": 30.0,
        "lc_win_rate": lc_win_rate, "lc_win_rate_low": lc_win_rate - 0.05, "lc_win_rate_high": lc_win_rate + 0.05,
        "length_matched/win_minus_loss": win_minus_loss / 2, "length_matched/win_minus_loss_low": -0.3,
        "length_matched/win_minus_loss_high": 0.4, "length_matched/valid_pairs": 61.0, "length_ratio": 0.8,
    }  # fmt: skip
    (directory / "metrics.json").write_text(json.dumps(metrics))
    return metrics


def test_rows_and_report_hold_each_variants_own_figures(tmp_path: Path) -> None:
    vanilla_ppo = write_ppo_output(
        tmp_path / "vanilla" / "ppo", kl_per_step=0.14, reward_per_step=0.5, steps=5, stop=True
    )
    vanilla_eval = write_eval_output(tmp_path / "vanilla" / "eval", win_minus_loss=-0.4, lc_win_rate=0.5)
    stable_ppo = write_ppo_output(
        tmp_path / "ppo_max" / "ppo", kl_per_step=0.01, reward_per_step=0.1, steps=8, stop=False
    )
    stable_eval = write_eval_output(tmp_path / "ppo_max" / "eval", win_minus_loss=0.25, lc_win_rate=0.6)
    files = [
        VariantFiles("vanilla", "vanilla", tmp_path / "vanilla" / "ppo", tmp_path / "vanilla" / "eval"),
        VariantFiles("ppo_max", "ppo_max", tmp_path / "ppo_max" / "ppo", tmp_path / "ppo_max" / "eval"),
        VariantFiles("broken", "ppo_max; value_clip=null", error="Failed: out of memory"),
    ]
    results = [read_variant(item) for item in files]
    written = write_report(results, tmp_path / "comparison", "test", "Two variants and a failure.", ["base: here"])

    rows = read_rows(tmp_path / "comparison")
    assert rows == [result.row for result in results]
    for row, ppo_metrics, eval_metrics in ((rows[0], vanilla_ppo, vanilla_eval), (rows[1], stable_ppo, stable_eval)):
        assert row.final_kl == ppo_metrics["last/kl/token_k3"] and row.selected_kl == ppo_metrics["val/kl_best"]
        assert (row.held_out_gain.mean, row.held_out_gain.low, row.held_out_gain.high) == (
            ppo_metrics["val/reward_gain"],
            ppo_metrics["val/reward_gain_low"],
            ppo_metrics["val/reward_gain_high"],
        )
        assert (row.judge_win_minus_lose.mean, row.judge_win_minus_lose.low, row.judge_win_minus_lose.high) == (
            eval_metrics["win_minus_loss"],
            eval_metrics["win_minus_loss_low"],
            eval_metrics["win_minus_loss_high"],
        )
        assert (row.lc_win_rate.mean, row.lc_win_rate.low, row.lc_win_rate.high) == (
            eval_metrics["lc_win_rate"],
            eval_metrics["lc_win_rate_low"],
            eval_metrics["lc_win_rate_high"],
        )
        assert row.length_matched_win_minus_lose.mean == eval_metrics["length_matched/win_minus_loss"]
        assert (row.length_matched_pairs, row.length_ratio) == (61, 0.8)
        assert row.ppo_minutes == ppo_metrics["wall_time_s"] / 60 and row.eval_minutes == 0.5
    assert (rows[0].guard_stop_step, rows[0].guard_reason) == (5, GUARD_MESSAGE.split(": ", 1)[1])
    assert rows[1].guard_stop_step is None and rows[2].error == "Failed: out of memory"
    assert len(results[0].history) == 6 and results[2].history == []

    for name in (MONITORS_PNG, OUTCOMES_PNG):
        assert written[name].read_bytes().startswith(PNG_MAGIC)
    markdown = (tmp_path / "comparison" / COMPARISON_MD).read_text()
    assert f"| vanilla | vanilla | {rows[0].final_kl:.4g} |" in markdown
    assert signed_interval(rows[1].judge_win_minus_lose, percent=True) in markdown  # "+25.0% (+15.0% to +35.0%)"
    assert "The collapse guard stopped `vanilla` at step 5 (per-token KL to the reference 0.7 > max_kl 0.5" in markdown
    assert "over-optimisation signature: `vanilla`." in markdown  # reward up, judge interval below 0
    assert "Held-out gain over the SFT policy beyond chance (95% interval above 0): `vanilla`, `ppo_max`." in markdown
    assert "`broken` failed: Failed: out of memory" in markdown
    assert "| 0.600 (0.550 to 0.650) | +12.5% (-30.0% to +40.0%), n=61 | 0.8 |" in markdown  # ppo_max's LC cells
    assert "win rate vs SFT above 0.5 beyond chance (95% interval above 0.5): `ppo_max`." in markdown

    flat = flat_rows(rows)
    assert flat[1]["judge_win_minus_lose_mean"] == stable_eval["win_minus_loss"] and flat[2]["final_kl"] is None
