"""The Prefect side of human evaluation (flow: flows/human_eval.py; the judging itself:
rlhf_core/evaluation/judges/human.py).

- `generate_pairs_task`: model A's and model B's replies to the eval prompts and their length-matched
  pairs, when the session starts from two models instead of an `rlhf eval` generations file;
- `ask_pairs`: one form in the Prefect UI for a batch of pairs (`pause_flow_run` with `wait_for_input`),
  turned into answers;
- `report_task`: once every pair is answered, the same files and report as the other judges, a markdown
  artifact, and an MLflow run when tracking is configured.

The form is a `RunInput` model built per batch: for each pair at position N a required field
`choice_N` ("reply 1", "reply 2" or "tie"), whose description (shown under its label) is the
conversation and the two replies in the shown order, the first after the instructions, and an optional
`comment_N` (texts: judges/human.py). The form has no description of its own: the UI would squeeze it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
from mlflow import MlflowClient
from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from prefect.flow_runs import pause_flow_run
from prefect.input import RunInput
from prefect.runtime import flow_run
from pydantic import Field, create_model

from rlhf_core.atomic import atomic_write_text
from rlhf_core.config import Config
from rlhf_core.evaluation.generation import Reply
from rlhf_core.evaluation.judges.human import (
    ANSWERS_FILE,
    MATCHED_PAIRS_FILE,
    PAIRS_FILE,
    PLAN_FILE,
    HumanAnswer,
    HumanSession,
    Preference,
    ShownPair,
    load_session,
    pair_markdown,
    pair_question,
)
from rlhf_core.evaluation.judges.verdicts import Judgement, Verdict
from rlhf_core.evaluation.length_matching import length_matched_pairs
from rlhf_core.evaluation.model_dirs import resolve_model_dir
from rlhf_core.evaluation.outputs import (
    MATCHED_VERDICTS_FILE,
    VERDICTS_FILE,
    GeneratedPair,
    generation_rows,
    matched_generation_rows,
    verdict_rows,
    write_jsonl,
)
from rlhf_core.evaluation.plots import plot_win_tie_lose
from rlhf_core.evaluation.prompts import EvalPrompt, evaluation_prompts
from rlhf_core.evaluation.report import EvaluationReport, JudgedPair, build_report
from rlhf_core.evaluation.report_markdown import render_markdown
from rlhf_core.models.base import DTYPES
from rlhf_core.models.loading import load_causal_lm
from rlhf_core.stages.evaluate import PLOT_FILE, REPORT_JSON, REPORT_MD, draw_replies
from rlhf_core.stages.result import write_metrics
from tasks.tracking.lineage import FLOW_RUN_ID_TAG, UNKNOWN
from tasks.tracking.metrics_logger import (
    TRACKING_URI_ENV,
    MlflowLogger,
    get_or_create_experiment,
    local_artifact_location,
)
from tasks.tracking.mlflow_runs import PARENT_RUN_TAG, ROLE_TAG, STAGE_ROLE, STAGE_TAG, close_run, run_url
from tasks.tracking.run_owner import owner_tags

STAGE = "human-eval"
REPORT_ARTIFACT_KEY = "human-eval-report"
FORM_NAME = "PairVerdicts"


# ---- generation


def model_samples(
    config: Config, model: str | Path, prompts: Sequence[EvalPrompt], device: torch.device
) -> tuple[list[Reply], list[list[Reply]]]:
    """One model's main replies to `prompts` and the further ones for the length-matched pairs, as
    `rlhf eval` samples them (`draw_replies`)."""
    loaded, tokenizer = load_causal_lm(resolve_model_dir(model), dtype=DTYPES[config.model.dtype], device=device)
    return draw_replies(config, loaded, tokenizer, prompts, label=None)


@task(name="human-eval-generate", cache_policy=NO_CACHE)
def generate_pairs_task(config: Config, data_dir: Path, model_a: str, model_b: str, out_dir: Path) -> Path:
    """Write `out_dir/generations.jsonl` (both models' replies to the eval prompts) and
    `out_dir/generations_matched.jsonl` (their length-matched pairs); returns the first's path.

    A session directory that already has the file keeps it: its answers are about those replies, and
    sampling again could give others (other hardware, other library versions).
    """
    path = Path(out_dir) / PAIRS_FILE
    if path.is_file():
        return path
    for model in (model_a, model_b):
        resolve_model_dir(model)  # fail before loading anything
    prompts = evaluation_prompts(data_dir, config.evaluation.max_prompts)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    main_a, extra_a = model_samples(config, model_a, prompts, device)
    main_b, extra_b = model_samples(config, model_b, prompts, device)
    samples_a = [[main, *extra] for main, extra in zip(main_a, extra_a)]
    samples_b = [[main, *extra] for main, extra in zip(main_b, extra_b)]
    matched = length_matched_pairs(prompts, samples_a, samples_b)
    write_jsonl(Path(out_dir) / MATCHED_PAIRS_FILE, matched_generation_rows(matched))
    return write_jsonl(path, generation_rows(prompts, main_a, main_b))


# ---- forms


def choice_field(position: int) -> str:
    """The form field holding the answer about the pair at `position`."""
    return f"choice_{position}"


def comment_field(position: int) -> str:
    """The form field holding the optional comment about the pair at `position`."""
    return f"comment_{position}"


def answer_form(batch: Sequence[ShownPair], total: int) -> type[RunInput]:
    """The `RunInput` model of one form: per pair a choice, described by the pair itself, and a comment."""
    fields: dict[str, Any] = {}
    for shown in batch:
        position = shown.planned.position
        text = pair_markdown(shown, instructions=shown is batch[0])
        fields[choice_field(position)] = (Preference, Field(title=pair_question(position, total), description=text))
        fields[comment_field(position)] = (str, Field("", title=f"Pair {position}: comment"))
    return create_model(FORM_NAME, __base__=RunInput, **fields)


def pause_key(batch: Sequence[ShownPair]) -> str:
    """The pause key of a batch's form: its positions, so a retried flow run gets back the same form's input."""
    return f"pairs-{batch[0].planned.position}-{batch[-1].planned.position}"


def answers_from_form(filled: RunInput, batch: Sequence[ShownPair], session: str) -> list[HumanAnswer]:
    """The submitted form as one answer per pair of the batch."""
    answered_at = datetime.now(UTC).isoformat()
    return [
        HumanAnswer(
            pair_key=shown.planned.pair_key,
            prompt_id=shown.planned.prompt_id,
            choice=Preference(getattr(filled, choice_field(shown.planned.position))),
            comment=getattr(filled, comment_field(shown.planned.position)).strip(),
            answered_at=answered_at,
            session=session,
        )
        for shown in batch
    ]


def ask_pairs(batch: Sequence[ShownPair], total: int, timeout_s: int, poll_interval_s: int) -> list[HumanAnswer]:
    """Pause the flow run on the form of `batch` until someone submits it; their answers.

    Call from the flow. Raises prefect's FlowPauseTimeout when nobody answers within `timeout_s`.
    """
    filled = pause_flow_run(
        wait_for_input=answer_form(batch, total), timeout=timeout_s, poll_interval=poll_interval_s, key=pause_key(batch)
    )
    return answers_from_form(filled, batch, session=flow_run.get_id() or UNKNOWN)


# ---- report


def judged_pairs(generated: Sequence[GeneratedPair], judgements: Sequence[Judgement]) -> list[JudgedPair]:
    """The report's view of each pair people judged (they give verdicts, not scores)."""
    return [
        JudgedPair(item.pair.pair_key, item.pair.category, item.tokens_a, item.tokens_b, judgement.verdict)
        for item, judgement in zip(generated, judgements)
    ]


def write_results(
    session: HumanSession, config: Config, model_a: str, model_b: str, other_judges: dict[str, dict[str, Verdict]]
) -> EvaluationReport:
    """verdicts.jsonl, report.json, report.md, the chart and finally metrics.json of a fully answered session.

    The same files, in the same formats, as `rlhf eval` writes for the other judges (verdicts_matched.jsonl
    and the length-matched figures when the session asked length-matched pairs; their samples per model
    are taken from `config`); the bootstrap is seeded with the session's seed. There is no alignment
    tax: it is a property of the models, in `rlhf eval`'s report.
    """
    out_dir = session.out_dir
    judgements, matched = session.judgements(), session.matched_judgements()
    info = session.info()
    write_jsonl(out_dir / VERDICTS_FILE, verdict_rows(session.generated, judgements, info.name))
    asked_matched = (out_dir / MATCHED_PAIRS_FILE).is_file()  # possibly none matched
    if asked_matched:
        write_jsonl(out_dir / MATCHED_VERDICTS_FILE, verdict_rows(session.matched, matched, info.name))
    report = build_report(
        judged_pairs(session.generated, judgements),
        info,
        model_a,
        model_b,
        config.evaluation.generation,
        session.plan.seed,
        other_judges=other_judges,
        length_matched=judged_pairs(session.matched, matched) if asked_matched else None,
        samples_per_model=config.evaluation.length_matched_samples,
    )
    atomic_write_text(out_dir / REPORT_JSON, report.model_dump_json(indent=2) + "\n")
    atomic_write_text(out_dir / REPORT_MD, render_markdown(report))
    plot_win_tie_lose(report, out_dir / PLOT_FILE)
    write_metrics(out_dir, report.metrics())
    return report


def configured_tracking_uri(config: Config) -> str | None:
    """MLFLOW_TRACKING_URI, else `tracking.tracking_uri`; None when neither is set (nothing is logged)."""
    return os.environ.get(TRACKING_URI_ENV) or config.tracking.tracking_uri


def log_to_mlflow(
    tracking_uri: str,
    experiment: str,
    out_dir: Path,
    params: dict[str, Any],
    metrics: dict[str, float],
    parent_run_id: str | None,
) -> str:
    """One MLflow run `human-eval` (nested under `parent_run_id` if given) with params, metrics and the
    session's files; returns a link to it (its id for a local store)."""
    client = MlflowClient(tracking_uri=tracking_uri)
    experiment_id = get_or_create_experiment(client, experiment, local_artifact_location(tracking_uri, Path.cwd()))
    tags = {ROLE_TAG: STAGE_ROLE, STAGE_TAG: STAGE, FLOW_RUN_ID_TAG: flow_run.get_id() or UNKNOWN, **owner_tags()}
    if parent_run_id:
        tags[PARENT_RUN_TAG] = parent_run_id
    run_id = client.create_run(experiment_id, run_name=STAGE, tags=tags).info.run_id
    try:
        logger = MlflowLogger(run_id, client)
        logger.log_params(params)
        logger.log_metrics(metrics, step=0)
        for name in (PLAN_FILE, ANSWERS_FILE, VERDICTS_FILE, REPORT_JSON, REPORT_MD, MATCHED_VERDICTS_FILE):
            if (out_dir / name).is_file():  # no verdicts_matched.jsonl without length-matched pairs
                client.log_artifact(run_id, str(out_dir / name))
        client.log_artifacts(run_id, str(out_dir / PLOT_FILE.parent), artifact_path=PLOT_FILE.parent.as_posix())
    except BaseException as error:
        close_run(client, run_id, error)
        raise
    close_run(client, run_id)
    return run_url(tracking_uri, experiment_id, run_id) or run_id


@task(name="human-eval-report", cache_policy=NO_CACHE)
def report_task(
    out_dir: Path,
    config: Config,
    model_a: str,
    model_b: str,
    other_judges: dict[str, dict[str, Verdict]],
    mlflow_parent_run_id: str | None,
) -> dict[str, float]:
    """Write the report of the answered session, publish it as an artifact, log it to MLflow if configured;
    returns the figures of metrics.json."""
    session = load_session(out_dir)
    report = write_results(session, config, model_a, model_b, other_judges)
    metrics = report.metrics()
    markdown = render_markdown(report)
    tracking_uri = configured_tracking_uri(config)
    if tracking_uri is not None:
        params = {
            "judge": report.judge.name,
            "model_a": model_a,
            "model_b": model_b,
            "seed": session.plan.seed,
            "session_dir": str(out_dir),
        }
        link = log_to_mlflow(tracking_uri, config.tracking.experiment, out_dir, params, metrics, mlflow_parent_run_id)
        markdown += f"\nMLflow run: {link}\n"
    create_markdown_artifact(markdown=markdown, key=REPORT_ARTIFACT_KEY, description="Human evaluation report")
    return metrics
