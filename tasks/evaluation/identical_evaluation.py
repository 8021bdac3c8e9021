"""The evaluate stage of a pipeline run whose PPO policy is the SFT model by content: not evaluated.

A PPO run whose selection hands on its start (step 0) installs the SFT model's own files as its model/
(rlhf_core/stages/ppo.py), so the policy's content hash (a training stage's `StageOutput.sha256`: the hash
of its model directory) is the SFT model's. Generating both models' replies and judging them would spend
the whole evaluation (38 minutes in one ablation) to find what is known without it: the same weights and
the same seed give the same reply to every prompt, so every pair is a tie. The content hash is the signal,
not selection.json's chosen step: it is what every comparison of models in the pipeline and the promotion
keys on (rlhf_core/promotion/evidence.py), and it holds whoever made the files; selection.json only words the
reason.

Instead of the evaluate task the pipeline then writes `eval/` with
- metrics.json: `IDENTICAL_MODELS_FIGURES` (a tie, and `identical_models` 1, which the promotion gate
  always fails: a policy the same as its baseline has won nothing),
- not_evaluated.json: the status "identical models, not evaluated", the reason and both content hashes,
and tags the MLflow parent run with the same status and reason (`evaluation.status`, `evaluation.reason`);
`evaluation_tags` and `evaluation_summary` (tasks/evaluation/evaluate_task.py) pass them on to the registered policy
version and to the run's summary.
"""

from __future__ import annotations

import json
from pathlib import Path

from rlhf_core.atomic import atomic_write_text
from rlhf_core.layout import SELECTION_FILE, stage_output_dir
from rlhf_core.promotion.evidence import IDENTICAL_MODELS, IDENTICAL_MODELS_FIGURE, IDENTICAL_MODELS_FIGURES
from rlhf_core.stage_outputs import StageOutput, directory_sha256
from rlhf_core.stages.result import write_metrics
from tasks.registry.registered_models import EVALUATION_STATUS_TAG
from tasks.stages.stage_runs import StageContext

NOT_EVALUATED_FILE = "not_evaluated.json"
EVALUATION_REASON_TAG = "evaluation.reason"


def models_identical(model_a: StageOutput, model_b: StageOutput) -> bool:
    """Whether two model outputs have the same content (both hashes are of their model directories)."""
    return model_a.model_dir is not None and model_b.model_dir is not None and model_a.sha256 == model_b.sha256


def chosen_step(ppo_out_dir: Path) -> int | None:
    """The step PPO's selection handed on (selection.json), or None without the file."""
    path = Path(ppo_out_dir) / SELECTION_FILE
    if not path.is_file():
        return None
    return int(json.loads(path.read_text(encoding="utf-8"))["chosen_step"])


def identical_models_reason(policy: StageOutput, sft: StageOutput) -> str:
    """Why the pair is not evaluated, in words: the shared content hash, and the PPO run's start handed on."""
    handed_on_start = chosen_step(policy.out_dir) == 0
    start = " (its PPO run handed on its start: selection.json chose step 0)" if handed_on_start else ""
    return (
        f"{IDENTICAL_MODELS}: the PPO policy's content sha256 is the SFT model's ({sft.sha256[:12]}){start}; "
        "the same weights give the same replies, so every pair would be a tie"
    )


def write_not_evaluated(policy: StageOutput, sft: StageOutput, out_dir: Path) -> StageOutput:
    """`out_dir` as the evaluate stage's output for a policy identical to the SFT model: not_evaluated.json
    and metrics.json, nothing generated or judged (see the module docstring)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    record = {
        "status": IDENTICAL_MODELS,
        "reason": identical_models_reason(policy, sft),
        "model_a": {"name": "PPO policy", "out_dir": str(policy.out_dir), "sha256": policy.sha256},
        "model_b": {"name": "SFT model", "out_dir": str(sft.out_dir), "sha256": sft.sha256},
    }
    atomic_write_text(out_dir / NOT_EVALUATED_FILE, json.dumps(record, indent=2) + "\n")
    write_metrics(out_dir, IDENTICAL_MODELS_FIGURES)  # last: the output is complete
    return StageOutput(
        stage="evaluate", out_dir=out_dir, sha256=directory_sha256(out_dir), metrics=dict(IDENTICAL_MODELS_FIGURES)
    )


def skip_identical_evaluation(policy: StageOutput, sft: StageOutput, context: StageContext) -> StageOutput:
    """The pipeline's evaluate stage for a policy identical to the SFT model (`write_not_evaluated`); the
    parent MLflow run is tagged with the status and the reason."""
    output = write_not_evaluated(policy, sft, stage_output_dir(context.run_dir, "evaluate"))
    client = context.tracking.client()
    client.set_tag(context.tracking.parent_run_id, EVALUATION_STATUS_TAG, IDENTICAL_MODELS)
    client.set_tag(context.tracking.parent_run_id, EVALUATION_REASON_TAG, identical_models_reason(policy, sft))
    return output


def is_not_evaluated(output: StageOutput) -> bool:
    """Whether an evaluate output is `skip_identical_evaluation`'s, not an evaluation's."""
    return output.metrics.get(IDENTICAL_MODELS_FIGURE) == 1.0


def not_evaluated_record(output: StageOutput) -> dict[str, object]:
    """not_evaluated.json of such an output."""
    return json.loads((output.out_dir / NOT_EVALUATED_FILE).read_text(encoding="utf-8"))


def not_evaluated_tags(output: StageOutput) -> dict[str, str]:
    """Tags for the policy version: the status and the reason, and the baseline; no figures, none was measured."""
    record = not_evaluated_record(output)
    return {
        EVALUATION_STATUS_TAG: IDENTICAL_MODELS,
        EVALUATION_REASON_TAG: str(record["reason"]),
        "evaluation.baseline": "SFT model",
    }


def not_evaluated_summary(output: StageOutput) -> list[str]:
    """The lines `rlhf run` ends with for such an output."""
    return [f"evaluation: PPO policy (A) vs SFT model (B): {not_evaluated_record(output)['reason']}"]
