"""What the promotion gate reads of the challenger against its baseline, and how that evidence was had.

No comparison is made twice. flows/promote.py has the evidence one of three ways:
- evaluated: the evaluate task ran (tasks/evaluation/evaluate_task.py), generating both models' replies and judging
them;
- reused: the evaluate task's cache answered. Its key is the content of the data, of both models and of
  the judge, the config sections it reads and the code (tasks/execution/caching.py), never a path, and a record
  counts only while the output it names is intact. A model downloaded from the registry hashes as the
  stage output it was registered from (`download_version`), so the pipeline's evaluation of its policy
  against the SFT model, or an earlier promotion's of the same pair, is read back instead of judged again
  (the same runs directory holds the cache: `runs` by default, for the pipeline and the promotion alike);
- identical: the challenger's content is the baseline's. Both would give the same replies to every
  prompt (the same weights, the same seed), judged the same, so every pair is a tie and its figures are
  known without generating: `IDENTICAL_MODELS_FIGURES`. They are not evaluated against each other.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from rlhf_core.stage_outputs import StageOutput

IDENTICAL_MODELS = "identical models, not evaluated"
# The figure that marks such evidence (1.0): the promotion gate fails it, whatever its bounds, and the
# pipeline's evaluate stage records it in its metrics.json when the PPO policy is the SFT model.
IDENTICAL_MODELS_FIGURE = "identical_models"
# The figures of a model against itself: all ties, so A wins as often as B (0, interval [0, 0]), the
# length-controlled win rate is even (0.5, interval [0.5, 0.5]), the replies are as long (ratio 1) and
# the reference replies as likely (alignment tax 0). The names are those of metrics.json (report.py).
IDENTICAL_MODELS_FIGURES: dict[str, float] = {
    "lc_identifiable": 1.0,  # known exactly, not fitted
    "lc_win_rate": 0.5,
    "lc_win_rate_low": 0.5,
    "lc_win_rate_high": 0.5,
    "length_ratio": 1.0,
    "win_rate": 0.0,
    "tie_rate": 1.0,
    "lose_rate": 0.0,
    "win_minus_loss": 0.0,
    "win_minus_loss_low": 0.0,
    "win_minus_loss_high": 0.0,
    "alignment_tax": 0.0,
    "alignment_tax_relative": 0.0,
    "judge_in_sample": 0.0,  # no judge was asked
    IDENTICAL_MODELS_FIGURE: 1.0,
}


class Evidence(BaseModel):
    """The comparison's figures (metrics.json names), its MLflow run (None: not evaluated), and `note`:
    how it was had when not by a new evaluation (shown in the decision)."""

    model_config = ConfigDict(frozen=True)

    metrics: dict[str, float]
    mlflow_run_id: str | None = None
    note: str | None = None


def evaluation_evidence(output: StageOutput, reused: bool) -> Evidence:
    """The evidence of the evaluate task's output; `reused`: its cache answered (the task run is Cached)."""
    note = None
    if reused:
        note = (
            f"reused the evaluation of MLflow run {output.mlflow_run_id}: the same challenger, baseline, data "
            "and judge by content, and the same evaluation settings; not judged again"
        )
    return Evidence(metrics=output.metrics, mlflow_run_id=output.mlflow_run_id, note=note)


def identical_models_evidence(sha256: str) -> Evidence:
    """The evidence of a challenger whose content is its baseline's: a tie, not evaluated."""
    note = f"{IDENTICAL_MODELS}: the challenger's content sha256 is the baseline's ({sha256[:12]}), every pair a tie"
    return Evidence(metrics=IDENTICAL_MODELS_FIGURES, note=note)
