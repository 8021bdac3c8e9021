"""The evaluate stage as a Prefect task (the models it compares come from tasks/registry/downloads.py).

- `evaluate_task`: model A (the PPO policy, or a challenger) against model B (the SFT model, or the
  champion) on the held-out prompts, through `rlhf_core.stages.evaluate.run_evaluate`. Like the other
  stage tasks (tasks/stages/stage_tasks.py) it is cached on content (the data, both models, the judge, the config
  sections it reads), holds this machine's training slot while it generates, and runs in a nested
  MLflow run. That run holds the figures of metrics.json as `final.*` metrics (the length-controlled
  win rate, the length-matched pairs' outcome and the length ratio first, then win/tie/lose rates and
  win minus loss with their intervals, the reward-model judge's mean score difference A - B with its
  interval, lengths, alignment tax), the per-pair table (`pairs.json`, via
  `log_table`), the Figure-10 chart (`plots/win_rate.png`), report.md, report.json and the
  length-matched pairs' files (generations_matched.jsonl, verdicts_matched.jsonl); the report is
  also a Prefect markdown artifact (`evaluate-report`), and the first pairs a table artifact
  (`evaluate-samples`: prompt, both replies, the verdict).
- `JudgeSpec`: which judge, and what pins it for the cache key: the reward model's content hash, or
  the LLM judge's model name. Whether a reward-model judge is in-sample is decided by `run_evaluate`
  from model A's record of the reward model PPO optimised against.
- `evaluation_tags` and `evaluation_summary`: what the registered version and `rlhf run` say of it (of
  an evaluation, or of a pair not evaluated because identical: tasks/evaluation/identical_evaluation.py).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Literal

import pandas as pd
from mlflow import MlflowClient
from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.logging import get_run_logger
from pydantic import BaseModel, ConfigDict

from rlhf_core.config import Config
from rlhf_core.evaluation.judges.llm_endpoint import LlmEndpoint
from rlhf_core.evaluation.outputs import (
    ANCHOR_GENERATIONS_FILE,
    ANCHOR_VERDICTS_FILE,
    GENERATIONS_FILE,
    MATCHED_GENERATIONS_FILE,
    MATCHED_VERDICTS_FILE,
    VERDICTS_FILE,
    read_jsonl,
)
from rlhf_core.evaluation.report import EvaluationReport, Rate, ScoreDifference
from rlhf_core.stage_outputs import StageOutput
from rlhf_core.stages.evaluate import PLOT_FILE, REPORT_JSON, REPORT_MD, run_evaluate
from tasks.evaluation.identical_evaluation import is_not_evaluated, not_evaluated_summary, not_evaluated_tags
from tasks.execution.caching import StageCachePolicy
from tasks.execution.concurrency import training_slot
from tasks.registry.registered_models import EVALUATION_STATUS_TAG
from tasks.stages.artifacts import publish_table
from tasks.stages.stage_runs import STAGE_SECTIONS, StageContext, tracked_stage
from tasks.stages.stage_tasks import STAGE_TASK_OPTIONS

PAIRS_TABLE = "pairs.json"
REPLIES_SUBDIR = "replies"  # in the stage cache: each evaluated model's replies (rlhf_core/evaluation/model_replies.py)
EVALUATED = "evaluated"
EVALUATION_TAG_PREFIX = "evaluation."
# The figures of metrics.json that go on the evaluated version as tags, the length-controlled ones first.
HEADLINE_FIGURES = (
    "lc_identifiable",
    "lc_win_rate",
    "lc_win_rate_low",
    "lc_win_rate_high",
    "length_ratio",
    "length_matched/pairs",
    "length_matched/win_minus_loss",
    "length_matched/win_minus_loss_low",
    "length_matched/win_minus_loss_high",
    "win_rate",
    "tie_rate",
    "lose_rate",
    "win_minus_loss",
    "win_minus_loss_low",
    "win_minus_loss_high",
    "score_diff_mean",
    "score_diff_low",
    "score_diff_high",
    "valid_pairs",
    "alignment_tax",
    "alignment_tax_relative",
)


class JudgeSpec(BaseModel):
    """The judge of an evaluation: a reward model (`reward`, a stage output or a downloaded reward
    model) or an LLM (`llm_model`, the judge model the endpoint serves)."""

    model_config = ConfigDict(frozen=True)

    kind: Literal["rm", "llm"]
    reward: StageOutput | None = None
    llm_model: str | None = None

    @property
    def content_hash(self) -> str:
        """What enters the evaluation's cache key: the kind and the reward model's hash or the LLM's name."""
        identity = {"kind": self.kind, "reward": self.reward.sha256 if self.reward else None, "llm": self.llm_model}
        return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()


def llm_judge_spec(config: Config) -> JudgeSpec:
    """The LLM judge of `evaluation.llm_model` (or RLHF_JUDGE_MODEL); its endpoint's variables must be set."""
    return JudgeSpec(kind="llm", llm_model=LlmEndpoint.from_environment(config.evaluation.llm_model).model)


def judge_spec(config: Config, reward: StageOutput) -> JudgeSpec:
    """The judge `evaluation.judge` names, with `reward` as the reward model of the rm judge (the pipeline
    passes the policy's reward model, or the independent judge reward model: `evaluation.judge_rm`).

    People judge in the rlhf-human-eval flow, not inside a pipeline run, so with `human` the pipeline's
    evaluation uses the reward model (and says so in the log); the LLM judge needs its endpoint's
    variables set (checked here, before any work).
    """
    judge = config.evaluation.judge
    if judge == "llm":
        return llm_judge_spec(config)
    if judge == "human":
        get_run_logger().warning(
            "evaluation.judge is human: people judge in the rlhf-human-eval flow; this evaluation uses the reward model"
        )
    return JudgeSpec(kind="rm", reward=reward)


@task(
    name="evaluate",
    cache_policy=StageCachePolicy(
        stage="evaluate",
        config_sections=STAGE_SECTIONS["evaluate"],
        content_inputs=("data", "model_a", "model_b", "judge"),
    ),
    **STAGE_TASK_OPTIONS,
)
def evaluate_task(
    config: Config,
    data: StageOutput,
    model_a: StageOutput,
    model_b: StageOutput,
    judge: JudgeSpec,
    context: StageContext,
    names: tuple[str, str],
) -> StageOutput:
    """Model A against model B on the eval split of `data` (rlhf_core.stages.evaluate); `names` label
    them in the report (they do not enter the cache key). Each model's replies are kept in the stage
    cache (`replies/`), so the next evaluation of the same model (the SFT baseline of every ablation
    variant and retraining) reads them instead of sampling again."""
    inputs = {"data": data, "model_a": model_a, "model_b": model_b, "judge": judge.reward}
    with training_slot("evaluate"), tracked_stage("evaluate", config, context, inputs) as run:
        run_evaluate(
            config,
            data.out_dir,
            model_a.out_dir,
            model_b.out_dir,
            run.out_dir,
            judge=judge.kind,
            rm_dir=judge.reward.out_dir if judge.reward is not None else None,
            replies_dir=context.cache_dir / REPLIES_SUBDIR,
            names=names,
            logger=run.progress_logger(),
        )
        output = run.finish(model_dir=None)
        log_evaluation(run.client, run.run_id, output.out_dir)
    publish_table(
        "evaluate-samples", pair_rows(output.out_dir), "Sample generations of evaluate: both replies, verdict"
    )
    create_markdown_artifact(
        markdown=(output.out_dir / REPORT_MD).read_text(encoding="utf-8"),
        key="evaluate-report",
        description="Evaluation report (paper section 6)",
    )
    return output


def log_evaluation(client: MlflowClient, run_id: str, out_dir: Path) -> None:
    """report.md, report.json, the length-matched pairs' and the anchor pairs' files as artifacts, and one
    table row per judged pair (`pairs.json`).

    (metrics.json, the `final.*` metrics and plots/win_rate.png are logged by `StageRun.finish`.)
    """
    for name in (
        REPORT_MD,
        REPORT_JSON,
        MATCHED_GENERATIONS_FILE,
        MATCHED_VERDICTS_FILE,
        ANCHOR_GENERATIONS_FILE,
        ANCHOR_VERDICTS_FILE,
    ):
        client.log_artifact(run_id, str(out_dir / name))
    client.log_table(run_id, data=pd.DataFrame(pair_rows(out_dir)), artifact_file=PAIRS_TABLE)


def pair_rows(out_dir: Path) -> list[dict[str, object]]:
    """Each pair's prompt (its last message), both replies, their lengths, the verdict and the judge's detail."""
    rows = []
    for generated, verdict in zip(read_jsonl(out_dir / GENERATIONS_FILE), read_jsonl(out_dir / VERDICTS_FILE)):
        detail = {key: value for key, value in verdict.items() if isinstance(value, (int, float, str))}
        rows.append(
            {
                **detail,
                "prompt": generated["prompt"][-1]["content"],
                "reply_a": generated["reply_a"],
                "reply_b": generated["reply_b"],
            }
        )
    return rows


def read_report(output: StageOutput) -> EvaluationReport:
    """The EvaluationReport (report.json) of a finished evaluation."""
    return EvaluationReport.model_validate_json((output.out_dir / REPORT_JSON).read_text(encoding="utf-8"))


def evaluation_tags(output: StageOutput) -> dict[str, str]:
    """Tags for the evaluated model version: status, the MLflow run, the judge (kind, in-sample or not, and
    its description: which reward model, trained on what), baseline and headline figures; for a policy
    identical to its baseline, the status "identical models, not evaluated" and the reason."""
    if is_not_evaluated(output):
        return not_evaluated_tags(output)
    report = read_report(output)
    tags = {
        EVALUATION_STATUS_TAG: EVALUATED,
        f"{EVALUATION_TAG_PREFIX}run_id": str(output.mlflow_run_id),
        f"{EVALUATION_TAG_PREFIX}judge": report.judge.kind,
        f"{EVALUATION_TAG_PREFIX}judge_in_sample": str(report.judge.in_sample).lower(),
        f"{EVALUATION_TAG_PREFIX}judge_description": report.judge.description,
        f"{EVALUATION_TAG_PREFIX}baseline": report.model_b,
    }
    tags |= {
        f"{EVALUATION_TAG_PREFIX}{name}": f"{output.metrics[name]:.6g}"
        for name in HEADLINE_FIGURES
        if name in output.metrics
    }
    return tags


def _percent(rate: Rate | None) -> str:
    return "n/a" if rate is None else f"{rate.rate:.1%}"


def _score_diff_text(difference: ScoreDifference | None) -> str:
    if difference is None:
        return ""
    return f"; mean score A - B {difference.mean:+.4g} (95% CI {difference.low:+.4g} to {difference.high:+.4g})"


def length_controlled_summary(report: EvaluationReport) -> str:
    """The summary's headline: the length-controlled win rate with its interval, the length ratio, and the
    length-matched pairs' win minus loss."""
    result, length, matched = report.length_controlled, report.length, report.length_matched
    if result is None:
        rate = "n/a"
    else:
        unidentified = result.unidentified_reason()
        interval = f"{result.rate:.1%} (95% CI {result.low:.1%} to {result.high:.1%})"
        rate = interval if unidentified is None else unidentified
    ratio = "n/a" if length.length_ratio is None else f"{length.length_ratio:.2f}"
    text = (
        f"  length-controlled win rate of A {rate}; length ratio A/B {ratio} "
        f"({length.mean_tokens_a:.1f} vs {length.mean_tokens_b:.1f} tokens)"
    )
    if matched is not None:
        margin = matched.outcome.win_minus_loss
        interval = "n/a" if margin is None else f"{margin.rate:+.1%} (95% CI {margin.low:+.1%} to {margin.high:+.1%})"
        text += f"; {matched.outcome.valid} length-matched pairs: win - lose {interval}"
    return text


def evaluation_summary(output: StageOutput) -> list[str]:
    """The lines `rlhf run` ends with: who judged (the judge's role, worded as in report.md), the
    length-controlled headline, the rates, win minus loss and the judge's mean score difference with their
    intervals, where to look; or why it was not evaluated."""
    if is_not_evaluated(output):
        return not_evaluated_summary(output)
    report = read_report(output)
    overall = report.overall
    margin = overall.win_minus_loss
    interval = "n/a" if margin is None else f"{margin.rate:+.1%} (95% CI {margin.low:+.1%} to {margin.high:+.1%})"
    return [
        f"evaluation: {report.model_a} (A) vs {report.model_b} (B), judged by {report.judge.role}",
        length_controlled_summary(report),
        (
            f"  {overall.valid} valid pairs of {overall.pairs}: A wins {_percent(overall.win)}, ties "
            f"{_percent(overall.tie)}, B wins {_percent(overall.lose)}; win - lose {interval}"
            f"{_score_diff_text(report.score_diff)}"
        ),
        f"  report: {output.out_dir / REPORT_MD}; chart: {output.out_dir / PLOT_FILE}; MLflow run "
        f"{output.mlflow_run_id}",
    ]
