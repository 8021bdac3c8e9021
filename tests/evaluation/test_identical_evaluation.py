"""A PPO run that hands on its start is not evaluated against its SFT model: the pipeline's evaluate
step (flows/pipeline.py `evaluate_policy`) generates and judges nothing, and records why in the stage's output,
the MLflow parent run, the tags the policy is registered with and the run's summary; a policy that differs is
evaluated. No Prefect server: the evaluate task, which needs one, is stood in for where a call is expected."""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
from mlflow import MlflowClient

import flows.pipeline as pipeline
import rlhf_core.stages.evaluate as evaluate_stage
from fixtures.stage_outputs import stage_output
from fixtures.tiny_ppo import StageInputs, tiny_config
from rlhf_core.promotion.evidence import IDENTICAL_MODELS
from rlhf_core.stage_outputs import StageOutput
from rlhf_core.stages.ppo import run_ppo
from tasks.evaluation.evaluate_task import evaluation_summary, evaluation_tags
from tasks.evaluation.identical_evaluation import NOT_EVALUATED_FILE
from tasks.stages.stage_runs import StageContext
from tasks.tracking.mlflow_runs import TrackingTarget

pytestmark = pytest.mark.usefixtures("one_thread")

LOGGER = logging.getLogger("test_identical_evaluation")


@pytest.fixture(scope="module")
def start_handed_on(inputs: StageInputs, tmp_path_factory: pytest.TempPathFactory) -> StageOutput:
    """A tiny PPO run whose KL bound only its start meets: its selection hands on step 0."""
    out = tmp_path_factory.mktemp("ppo") / "ppo"
    run_ppo(tiny_config("ppo.guard.max_kl=1e-9"), inputs.data_dir, inputs.sft_dir, inputs.rm_dir, out)
    assert json.loads((out / "selection.json").read_text())["chosen_step"] == 0
    return stage_output("ppo", out)


@pytest.fixture
def context(mlflow_db: str, tmp_path: Path) -> StageContext:
    """A run directory and an MLflow parent run in a SQLite store under `tmp_path`."""
    uri = mlflow_db
    client = MlflowClient(uri)
    experiment_id = client.create_experiment("identical-evaluation")
    parent = client.create_run(experiment_id, run_name="pipeline").info.run_id
    tracking = TrackingTarget(tracking_uri=uri, experiment_id=experiment_id, parent_run_id=parent)
    return StageContext(run_dir=tmp_path / "run", cache_dir=tmp_path / ".cache", tracking=tracking)


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Counts of generation and judging (rlhf_core.stages.evaluate) and of the evaluate task being started."""
    counts = Counter[str]()

    def counting(name: str, function: Callable[..., object] | None = None) -> Callable[..., object]:
        def count(*args: object, **kwargs: object) -> object:
            counts[name] += 1
            return function(*args, **kwargs) if function is not None else None

        return count

    for name in ("generate_pairs", "judge_pairs"):
        monkeypatch.setattr(evaluate_stage, name, counting(name, getattr(evaluate_stage, name)))
    monkeypatch.setattr(pipeline, "with_cache_dir", lambda task, cache_dir: counting("evaluate_task"))
    return counts


def outputs_of(inputs: StageInputs, policy: StageOutput) -> dict[str, StageOutput]:
    return {
        "prepare-data": stage_output("prepare-data", inputs.data_dir, with_model=False),
        "sft": stage_output("sft", inputs.sft_dir),
        "reward": stage_output("reward", inputs.rm_dir),
        "judge-reward": stage_output("judge-reward", inputs.rm_dir),
        "ppo": policy,
    }


def test_a_ppo_run_that_hands_on_its_start_is_not_evaluated_and_says_why(
    inputs: StageInputs, start_handed_on: StageOutput, context: StageContext, calls: Counter[str]
) -> None:
    outputs = outputs_of(inputs, start_handed_on)
    assert start_handed_on.sha256 == outputs["sft"].sha256  # the SFT model's own files, by content
    output = pipeline.evaluate_policy(tiny_config(), outputs, context, context.cache_dir, LOGGER)
    assert calls == Counter()  # nothing generated, nothing judged, no evaluate task
    record = json.loads((output.out_dir / NOT_EVALUATED_FILE).read_text())
    assert record["status"] == IDENTICAL_MODELS
    reason = record["reason"]
    assert reason.startswith(f"{IDENTICAL_MODELS}: the PPO policy's content sha256 is the SFT model's")
    assert "selection.json chose step 0" in reason
    assert json.loads((output.out_dir / "metrics.json").read_text())["identical_models"] == 1.0
    assert output.out_dir == context.run_dir / "eval" and output.is_intact()
    parent = context.tracking.client().get_run(context.tracking.parent_run_id)
    assert parent.data.tags["evaluation.status"] == IDENTICAL_MODELS
    assert parent.data.tags["evaluation.reason"] == reason
    assert evaluation_tags(output) == {
        "evaluation.status": IDENTICAL_MODELS,
        "evaluation.reason": reason,
        "evaluation.baseline": "SFT model",
    }
    assert evaluation_summary(output) == [f"evaluation: PPO policy (A) vs SFT model (B): {reason}"]


def test_a_policy_that_differs_from_its_sft_model_is_evaluated(
    inputs: StageInputs, tmp_path: Path, context: StageContext, calls: Counter[str]
) -> None:
    changed = tmp_path / "ppo"
    (changed / "model").mkdir(parents=True)
    for path in (inputs.sft_dir / "model").iterdir():
        (changed / "model" / path.name).write_bytes(path.read_bytes())
    (changed / "model" / "generation_config.json").write_text("{}")  # one file differs: other content
    outputs = outputs_of(inputs, stage_output("ppo", changed))
    pipeline.evaluate_policy(tiny_config(), outputs, context, context.cache_dir, LOGGER)
    assert calls == Counter(evaluate_task=1)
    assert not (context.run_dir / "eval").exists()
