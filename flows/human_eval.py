"""The `rlhf-human-eval` flow: people judge model A's and model B's replies, pair by pair, in the Prefect UI.

Input: either a generations.jsonl written by `rlhf eval` (the same pairs the reward-model and LLM judges
saw, so their agreement with people can be measured) or two models and prepared data, whose replies
the flow samples first exactly as `rlhf eval` does; and a session directory `out_dir`.

The flow
1. resolves the configuration and checks the other judges' verdict files (before anyone is asked),
2. opens the session in `out_dir` (rlhf_core/evaluation/judges/human.py): copies the pairs in (with the
   length-matched pairs of generations_matched.jsonl when it lies beside the generations file, as
   `rlhf eval` leaves it: people judge those too, after the main pairs), records the seeded order in
   which each pair's replies are shown, and finds the pairs not yet answered,
3. pauses on one form per batch of `batch_size` pairs (per pair a choice, "reply 1", "reply 2" or "tie",
   shown with the conversation, Reply 1 and Reply 2 under its question, and an optional comment), and
   appends each submitted form's answers to answers.jsonl (fsynced) before showing the next,
4. when every pair is answered, writes the same files as the other judges (verdicts.jsonl with judge
   "human", report.json, report.md, plots/win_rate.png, metrics.json last), publishes the report as
   the markdown artifact `human-eval-report`, and logs an MLflow run when tracking is configured.

Rerunning the flow on the same `out_dir` resumes the session: it asks only the pairs still without an
answer; on a finished session it rebuilds the report (e.g. with more `other_verdicts`).

Pause, not suspend. `pause_flow_run` keeps the flow run's process alive, polling the API every
`poll_interval_s` until the form is submitted; `suspend_flow_run` ends the process and, on resume,
reschedules the run, which a worker then starts again from the top (so it needs a deployment, and
results persisted for every task that must not run twice). The flow pauses, deliberately:
- each form is followed by the next within seconds; a suspended run would go through a worker, a new
  process and the imports of torch and MLflow for every form, and work only as a deployment run,
  not when the flow is called from Python or run by `rlhf serve` during development;
- the held process is small (no model is loaded while waiting; generation, when asked for, is done
  and its memory released before the first form);
- what suspending would protect, the answers, is already durable: every answer is on disk before the
  next form is shown, so a process that dies (or a pause that times out, or a cancelled run) loses at
  most the open form, and the next run on the same `out_dir` resumes from the first unanswered pair.
Each form waits `pause_timeout_s` (default 24 h, Prefect's default is 1 h) before the run fails with
FlowPauseTimeout; nothing answered is lost then either. Prefect's pause loop only watches for the run
to be resumed: a run started from Python is stopped by stopping its process (Ctrl-C), not by
cancelling it in the UI.

Resuming with input from outside the UI: `prefect.flow_runs.resume_flow_run(flow_run_id,
run_input={"choice_3": "reply 1", "comment_3": ""})` (what the UI posts to `/flow_runs/{id}/resume`);
the keys of the paused state's `run_input_keyset` name the form's schema, whose fields' descriptions hold
the pairs.
"""

from __future__ import annotations

from pathlib import Path

from prefect import flow, get_run_logger
from prefect.artifacts import create_progress_artifact, update_progress_artifact
from pydantic import BaseModel, ConfigDict, Field, model_validator

from rlhf_core.config import load_config
from rlhf_core.evaluation.judges.human import MATCHED_PAIRS_FILE, batches, open_session
from rlhf_core.evaluation.outputs import read_verdicts
from rlhf_core.form_order import number_fields
from tasks.evaluation.human_eval import ask_pairs, generate_pairs_task, report_task

DEFAULT_PAUSE_TIMEOUT_S = 24 * 3600
DEFAULT_POLL_INTERVAL_S = 10
MAX_BATCH_SIZE = 10
PROGRESS_ARTIFACT_KEY = "human-eval-progress"


class HumanEvalSettings(BaseModel):
    """What a human-evaluation session runs on (the form of the Run dialog in the Prefect UI).

    The pairs come from `generations` or, when `data_dir` is set, from `model_a` and `model_b`
    answering the eval prompts of `data_dir` (then both models are required and `generations` must be
    empty). With `generations`, `model_a` and `model_b` are only the names the report shows.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, json_schema_extra=number_fields)

    out_dir: str = Field(description="The session directory (answers, plan, report); run again on it to resume.")
    generations: str | None = Field(
        None, description="generations.jsonl written by `rlhf eval` (in its --out directory, e.g. artifacts/eval)."
    )
    model_a: str | None = Field(None, description="Model A, under evaluation (e.g. artifacts/ppo).")
    model_b: str | None = Field(None, description="Model B, the baseline (e.g. artifacts/sft).")
    data_dir: str | None = Field(
        None, description="Prepared data: sample model A's and model B's replies to its eval prompts."
    )
    batch_size: int = Field(1, ge=1, le=MAX_BATCH_SIZE, description="Pairs per form.")
    seed: int | None = Field(None, description="Seed of the shown order of the replies (default: the config's seed).")
    pause_timeout_s: int = Field(
        DEFAULT_PAUSE_TIMEOUT_S, ge=60, description="How long each form waits for an answer before the run fails."
    )
    poll_interval_s: int = Field(
        DEFAULT_POLL_INTERVAL_S, ge=1, description="How often the paused run checks whether the form was submitted."
    )
    other_verdicts: list[str] = Field(
        default_factory=list, description="verdicts.jsonl of other judges on the same pairs, for agreement."
    )
    mlflow_parent_run_id: str | None = Field(None, description="Nest the MLflow run under this run.")
    config: list[str] = Field(default_factory=list, description="Overlay YAML files (e.g. configs/tiny.yaml).")
    overrides: list[str] = Field(default_factory=list, description="key.path=value overrides.")
    params_file: str = Field("params.yaml", description="The base parameter file.")

    @model_validator(mode="after")
    def one_source_of_pairs(self) -> HumanEvalSettings:
        if self.data_dir is None and self.generations is None:
            raise ValueError(
                "give the pairs: generations (an rlhf eval generations.jsonl) or data_dir with model_a and model_b"
            )
        if self.data_dir is not None:
            if self.generations is not None:
                raise ValueError("give generations or data_dir (to generate), not both")
            if self.model_a is None or self.model_b is None:
                raise ValueError("data_dir generates the pairs: model_a and model_b are both required")
        return self


@flow(name="rlhf-human-eval", description="People judge model A against model B, pair by pair, in Prefect UI forms.")
def rlhf_human_eval(settings: HumanEvalSettings) -> dict[str, float]:
    """Run (or resume) the human-evaluation session `settings` describes; returns its metrics.json figures."""
    logger = get_run_logger()
    config = load_config(settings.params_file, settings.config, settings.overrides)
    other_judges = dict(read_verdicts(Path(path)) for path in settings.other_verdicts)
    out_dir = Path(settings.out_dir).resolve()
    if settings.data_dir is not None:
        generations = generate_pairs_task(
            config, Path(settings.data_dir), str(settings.model_a), str(settings.model_b), out_dir
        )
    else:
        generations = Path(str(settings.generations))
    matched = generations.parent / MATCHED_PAIRS_FILE  # `rlhf eval` and generate_pairs_task write it beside
    seed = config.seed if settings.seed is None else settings.seed
    session = open_session(out_dir, generations, seed, matched if matched.is_file() else None)
    total, pending = len(session.plan.pairs), session.pending()
    logger.info("session %s: %d of %d pairs answered, asking %d", out_dir, total - len(pending), total, len(pending))
    progress = create_progress_artifact(
        progress=100.0 * (total - len(pending)) / total, key=PROGRESS_ARTIFACT_KEY, description="Pairs answered"
    )
    for batch in batches(pending, settings.batch_size):
        answers = ask_pairs(batch, total, settings.pause_timeout_s, settings.poll_interval_s)
        session.record(answers)
        answered = total - len(session.pending())
        update_progress_artifact(progress, progress=100.0 * answered / total)
        logger.info("recorded %d answers; %d of %d pairs answered", len(answers), answered, total)
    return report_task(
        out_dir,
        config,
        settings.model_a or "model A",
        settings.model_b or "model B",
        other_judges,
        settings.mlflow_parent_run_id,
    )
