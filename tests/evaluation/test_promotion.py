"""The rlhf-promote flow against a real MLflow registry (server with S3 artifacts) and a real Prefect server.

One module-scoped scenario on one policy model, and every test asserts on it. The policy versions name the
independent judge reward model registered with them (`lineage.judge_model` / `lineage.judge_version`, as the
pipeline's register step sets them), and no step configures a judge unless it says so:
  P. the pipeline's evaluate step judges its policy (the stage output registered as version 1) against its
     SFT model with its judge, as flows/pipeline.py does;
  A. version 1 is the challenger and there is no champion: compared with the SFT model its lineage names,
     judged by its registered judge, which is P's evaluation (reused, not judged again: the registry copies
     hash as the stage outputs); it passes the gate and becomes the champion with its evidence as tags;
  B. version 2 (its PPO run drifted: KL 0.9 > promotion.max_kl) is evaluated against the champion, fails,
     and the registry is left as it was: a Completed flow run in the state "Rejected", with the reason;
  B2. the same with `promotion.judge_reward_model: in_sample`: judged by its own reward model, flagged so;
  C. an override without a reason is refused before anything runs;
  D. the same override with a reason promotes version 2 (B's evaluation, reused) and records it;
  E. a rollback moves the champion back to version 1; F. a second one finds nothing earlier: Completed in
     the state "Nothing to roll back", with the reason;
  G. version 3 names no judge and none is configured: the flow fails saying how to fix it, changing nothing;
  H. another policy model whose version 1 is its SFT model's very content: not evaluated (a tie), rejected.
Generation and judging are counted per step (`rlhf_core.stages.evaluate`'s generate_pairs and judge_pairs).

The policies are copies of the tiny SFT model, told apart by a marker file, so both replies of every pair
are the same and every verdict is a tie: win minus loss is exactly 0 with a [0, 0] interval, which passes
`promotion.min_win_minus_loss_low = -0.5`, and the length-controlled win rate is exactly 0.5, which passes
`promotion.min_lc_win_rate_low = 0.4`; the length ratio is 1 and the alignment tax 0. What fails version 2
is the KL of its PPO run alone.
"""

from __future__ import annotations

import json
import shutil
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from fixtures.paths import PARAMS, TINY
from fixtures.stage_outputs import stage_output
from fixtures.tiny_ppo import save_rm_output, write_stage_inputs
from mlflow import MlflowClient
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, FlowRunFilter, FlowRunFilterId
from prefect.states import State

from prefect import flow
from prefect.states import StateType

import rlhf_core.stages.evaluate as evaluate_stage
from flows.pipeline import CACHE_DIR_NAME, run_directory
from flows.promote import rlhf_promote
from rlhf_cli.main import main
from rlhf_cli.exit_codes import REFUSED_EXIT_CODE
from rlhf_core.config import Config, load_config
from rlhf_core.models.tiny import load_tiny_model
from rlhf_core.reward.training_data import training_data_record, write_training_data
from rlhf_core.stages.ppo import write_reward_record
from rlhf_core.stages.training_run import model_dir_sha256
from tasks.execution.caching import with_cache_dir
from tasks.evaluation.evaluate_task import JudgeSpec, evaluate_task
from tasks.tracking.lineage import flow_run_tags
from tasks.tracking.mlflow_runs import close_run, open_pipeline_run
from rlhf_core.stage_outputs import StageOutput
from tasks.promotion.promote_tasks import CHAMPION_ALIAS, DECISION_TAG, PREVIOUS_CHAMPION_TAG, JudgeChoice, PromotionResult
from rlhf_core.promotion.gate import NO_COLLAPSE_BOUND
from tasks.stages.stage_runs import StageContext
from tasks.registry.registered_models import CHALLENGER_ALIAS, REWARD_VERSION_TAG, STAGE_RUN_TAG, judge_model_name, judge_version_tags, lineage_output_tags, register, training_data_tags
from tasks.tracking.metrics_logger import get_or_create_experiment

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

POLICY = "promotion-policy"
SAME_AS_SFT = "promotion-policy-same"  # step H: a policy model whose version 1 is its SFT model
REWARD = "promotion-reward"
JUDGE = judge_model_name(REWARD)  # promotion-reward-judge
EXPERIMENT = "promotion-tests"
INDEPENDENT = (
    "independent reward model (trained on the PPO-prompt split, validated on rm_val, initialised from the base model)"
)


@dataclass
class Scenario:
    client: MlflowClient
    sft_dir: Path
    root: Path
    states: dict[str, State]
    tags_after: dict[str, dict[str, dict[str, str]]]  # step -> version -> tags
    champion_after: dict[str, str | None]  # step -> champion version
    artifacts: dict[str, dict[str, object]]  # step -> Prefect artifact key -> data
    task_states: dict[str, dict[str, str]]  # step -> task name -> final state name
    calls: dict[str, Counter[str]]  # step -> calls of generate_pairs and judge_pairs during it
    server_states: dict[str, State]  # step -> the flow run's final state as the Prefect server has it
    pipeline_evaluation: StageOutput  # step P


def ppo_run(client: MlflowClient, experiment_id: str, kl: float, guard_stopped: float) -> str:
    """An MLflow run standing for a PPO stage run: the final figures the gate reads."""
    run_id = client.create_run(experiment_id, run_name="ppo").info.run_id
    client.log_metric(run_id, "final.val/kl_best", kl, step=0)
    client.log_metric(run_id, "final.guard_enabled", 1.0, step=0)
    for bound in ("guard_length_band", "guard_kl_bound", "guard_perplexity_bound"):  # the default guard's
        client.log_metric(run_id, f"final.{bound}", 1.0, step=0)
    client.log_metric(run_id, "final.guard_stopped", guard_stopped, step=0)
    client.set_terminated(run_id)
    return run_id


def settings(runs_dir: Path, *overrides: str, **changes: object) -> dict[str, object]:
    return {
        "config": [str(TINY)],
        "overrides": [
            f"tracking.policy_model_name={POLICY}",
            f"tracking.reward_model_name={REWARD}",
            f"tracking.experiment={EXPERIMENT}",
            "evaluation.max_prompts=6",
            "promotion.min_win_minus_loss_low=-0.5",
            "promotion.min_lc_win_rate_low=0.4",
            *overrides,
        ],
        "params_file": str(PARAMS),
        "runs_dir": str(runs_dir),
        **changes,
    }


def config_of(parameters: dict[str, object]) -> Config:
    """The configuration the promotion flow loads from these settings."""
    return load_config(parameters["params_file"], parameters["config"], parameters["overrides"])


@flow(name="pipeline-evaluation-under-test")
def pipeline_evaluation(
    config: Config, data: StageOutput, policy: StageOutput, sft: StageOutput, judge: StageOutput, runs_dir: Path
) -> StageOutput:
    """The evaluate step as flows/pipeline.py runs it: PPO policy (A) vs SFT (B), by its judge reward model."""
    tracking = open_pipeline_run(config, runs_dir, run_name="pipeline-evaluation", tags=flow_run_tags())
    context = StageContext(run_dir=run_directory(runs_dir), cache_dir=runs_dir / CACHE_DIR_NAME, tracking=tracking)
    output = with_cache_dir(evaluate_task, context.cache_dir)(
        config, data, policy, sft, JudgeSpec(kind="rm", reward=judge), context, names=("PPO policy", "SFT model")
    )
    close_run(tracking.client(), tracking.parent_run_id)
    return output


def counted(calls: Counter[str], name: str, function: Callable[..., object]) -> Callable[..., object]:
    """`function`, counting its calls in `calls[name]`."""

    def counting(*args: object, **kwargs: object) -> object:
        calls[name] += 1
        return function(*args, **kwargs)

    return counting


def flow_run_state(state: State) -> State:
    """The flow run's final state as the Prefect server has it (what the UI and `--watch` show)."""
    with get_client(sync_client=True) as client:
        return client.read_flow_run(state.state_details.flow_run_id).state


def artifacts_of(state: State) -> dict[str, object]:
    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[state.state_details.flow_run_id]))
        )
    return {artifact.key: artifact.data for artifact in artifacts if artifact.key}


def task_states(state: State) -> dict[str, str]:
    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[state.state_details.flow_run_id]))
        )
    return {run.name.rsplit("-", 1)[0]: run.state.name for run in runs}


@pytest.fixture(scope="module")
def scenario(tmp_path_factory: pytest.TempPathFactory, mlflow_server: str, prefect_server: str) -> Iterator[Scenario]:
    from prefect.settings import PREFECT_API_URL, temporary_settings

    root = tmp_path_factory.mktemp("promotion")
    inputs = write_stage_inputs(root)
    client = MlflowClient(mlflow_server)
    experiment_id = get_or_create_experiment(client, EXPERIMENT, None)
    register_run = client.create_run(experiment_id, run_name="register").info.run_id
    reward = register(client, mlflow_server, register_run, REWARD, stage_output("reward", inputs.rm_dir), {}, None)
    judge_dir = save_rm_output(root / "judge_reward", load_tiny_model()[1], seed=2)
    write_training_data(judge_dir, training_data_record(inputs.data_dir, "ppo_pairs", "base"))
    judge_output = stage_output("judge-reward", judge_dir)
    judge = register(
        client, mlflow_server, register_run, JUDGE, judge_output, training_data_tags(judge_output), None
    )
    data_output = stage_output("prepare-data", inputs.data_dir, with_model=False)
    sft_output = stage_output("sft", inputs.sft_dir)
    lineage = lineage_output_tags({"prepare-data": data_output, "sft": sft_output})

    def register_policy(variant: str, kl: float, judged: bool = True, name: str = POLICY) -> str:
        """A copy of the SFT model as a PPO output (with the reward record PPO writes); a variant other than
        `sft` gets a marker file: new content, the same weights."""
        out_dir = root / f"policy-{variant}"
        shutil.copytree(inputs.sft_dir, out_dir)
        write_reward_record(out_dir, inputs.rm_dir, model_dir_sha256(inputs.rm_dir / "model"))
        if variant != "sft":
            (out_dir / "model" / "variant.txt").write_text(variant)
        tags = {
            **lineage,
            REWARD_VERSION_TAG: reward.version,
            STAGE_RUN_TAG: ppo_run(client, experiment_id, kl=kl, guard_stopped=0.0),
            **(judge_version_tags(judge) if judged else {}),
            # the pipeline's evaluation of this copy of the SFT model against it (tasks/evaluation/evaluate_task.py's tags)
            "evaluation.length_ratio": "1",
            "evaluation.alignment_tax_relative": "0",
        }
        return register(
            client, mlflow_server, register_run, name, stage_output("ppo", out_dir), tags, CHALLENGER_ALIAS
        ).version

    runs_dir = root / "runs"
    states: dict[str, State] = {}
    tags_after: dict[str, dict[str, dict[str, str]]] = {}
    champion_after: dict[str, str | None] = {}
    artifacts: dict[str, dict[str, object]] = {}
    task_states_of: dict[str, dict[str, str]] = {}
    running = Counter[str]()
    calls: dict[str, Counter[str]] = {}
    server_states: dict[str, State] = {}

    def promote(step: str, parameters: dict[str, object], name: str = POLICY) -> None:
        before = running.copy()
        states[step] = rlhf_promote(settings=parameters, return_state=True)
        calls[step] = running - before
        versions = client.search_model_versions(f"name = '{name}'")
        tags_after[step] = {str(version.version): dict(version.tags) for version in versions}
        champion_after[step] = client.get_registered_model(name).aliases.get(CHAMPION_ALIAS)
        artifacts[step] = artifacts_of(states[step])
        task_states_of[step] = task_states(states[step])
        server_states[step] = flow_run_state(states[step])

    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    monkeypatch.setenv("PREFECT_API_URL", prefect_server)
    monkeypatch.chdir(root)
    for counted_name in ("generate_pairs", "judge_pairs"):
        monkeypatch.setattr(
            evaluate_stage, counted_name, counted(running, counted_name, getattr(evaluate_stage, counted_name))
        )
    try:
        with temporary_settings(updates={PREFECT_API_URL: prefect_server}):
            assert register_policy("1", kl=0.05) == "1"
            before = running.copy()
            policy_output = stage_output("ppo", root / "policy-1")
            evaluated = pipeline_evaluation(
                config_of(settings(runs_dir)), data_output, policy_output, sft_output, judge_output, runs_dir
            )
            calls["P"] = running - before
            promote("A", settings(runs_dir))
            assert register_policy("2", kl=0.9) == "2"
            promote("B", settings(runs_dir))
            promote("B2", settings(runs_dir, "promotion.judge_reward_model=in_sample"))
            promote("C", settings(runs_dir, override=True))
            promote("D", settings(runs_dir, override=True, reason="people preferred it in the human evaluation"))
            promote("E", settings(runs_dir, mode="rollback", reason="complaints after the release"))
            promote("F", settings(runs_dir, mode="rollback"))
            assert register_policy("3", kl=0.05, judged=False) == "3"
            promote("G", settings(runs_dir))
            assert register_policy("sft", kl=0.05, name=SAME_AS_SFT) == "1"
            same = settings(runs_dir, f"tracking.policy_model_name={SAME_AS_SFT}", "promotion.min_lc_win_rate_low=0.5")
            promote("H", same, name=SAME_AS_SFT)
        yield Scenario(
            client,
            inputs.sft_dir,
            root,
            states,
            tags_after,
            champion_after,
            artifacts,
            task_states_of,
            calls,
            server_states,
            evaluated,
        )
    finally:
        monkeypatch.undo()


def result(scenario: Scenario, step: str) -> PromotionResult:
    state = scenario.states[step]
    assert state.is_completed(), state.message
    return state.result()


def test_without_a_champion_the_challenger_is_compared_with_sft_and_promoted_with_evidence(scenario: Scenario) -> None:
    first = result(scenario, "A")
    assert (first.decision, first.challenger, first.champion_before, first.champion_after) == (
        "promoted",
        "1",
        None,
        "1",
    )
    assert first.baseline == f"SFT model of version 1 ({scenario.sft_dir})"
    assert {check.name: check.passed for check in first.checks} == {
        "lc_win_rate_low": True,
        "win_minus_loss_low": True,
        "length_ratio": True,
        "alignment_tax_relative": True,
        "kl_to_reference": True,
        "no_collapse": True,
    }
    assert scenario.champion_after["A"] == "1"
    tags = scenario.tags_after["A"]["1"]
    assert tags[DECISION_TAG] == "promoted" and tags[PREVIOUS_CHAMPION_TAG] == "none"
    assert tags["promotion.gate"] == "passed"
    assert tags["promotion.check.kl_to_reference"] == "kl_to_reference = 0.05 (<= 0.3): pass"
    assert tags["promotion.check.win_minus_loss_low"] == "win_minus_loss_low = 0 (> -0.5): pass"
    assert tags["promotion.check.length_ratio"] == "length_ratio = 1 (in [0.67, 1.5]): pass"
    assert tags["promotion.check.no_collapse"] == f"no_collapse = 0 ({NO_COLLAPSE_BOUND}): pass"
    evaluation = scenario.client.get_run(tags["promotion.evaluation_run_id"])
    assert evaluation.data.metrics["final.tie_rate"] == 1.0  # the same weights: every pair a tie
    assert evaluation.data.metrics["final.score_diff_mean"] == 0.0  # identical replies, identical scores
    report = scenario.artifacts["A"]["promotion-decision"]
    assert (
        "# Promotion of `promotion-policy`: promoted" in report
        and "| kl_to_reference | 0.05 | <= 0.3 | pass |" in report
    )


def test_the_pipelines_evaluation_of_the_same_pair_is_reused_not_judged_again(scenario: Scenario) -> None:
    """The registry copies of the policy and the judge hash as the stage outputs the pipeline evaluated, with the
    same data and settings: A reads P's evaluation back, generating and judging nothing, and says so."""
    assert scenario.calls["P"] == Counter(generate_pairs=1, judge_pairs=1)
    first = result(scenario, "A")
    assert scenario.task_states["A"]["evaluate"] == "Cached"
    assert scenario.calls["A"] == Counter()  # no generation, no judge
    assert first.evaluation_run_id == scenario.pipeline_evaluation.mlflow_run_id
    assert first.evaluation_note is not None and first.evaluation_note.startswith(
        f"reused the evaluation of MLflow run {scenario.pipeline_evaluation.mlflow_run_id}"
    )
    assert "Evaluation: reused the evaluation" in first.message
    assert "- evaluation: reused the evaluation of MLflow run" in scenario.artifacts["A"]["promotion-decision"]
    checks = {check.name: check.value for check in first.checks}
    assert checks["win_minus_loss_low"] == scenario.pipeline_evaluation.metrics["win_minus_loss_low"]
    assert checks["lc_win_rate_low"] == scenario.pipeline_evaluation.metrics["lc_win_rate_low"]


def test_registry_models_in_an_evaluation_run_are_named_by_their_uri(scenario: Scenario) -> None:
    second = result(scenario, "B")
    assert scenario.calls["B"] == Counter(generate_pairs=1, judge_pairs=1)  # a new pair: evaluated
    assert second.evaluation_note is None
    evaluation = scenario.client.get_run(second.evaluation_run_id)
    assert evaluation.data.tags["input.model_a.uri"] == f"models:/{POLICY}/2"
    assert evaluation.data.tags["input.model_b.uri"] == f"models:/{POLICY}/1"
    assert evaluation.data.tags["input.judge.uri"] == f"models:/{JUDGE}/1"
    assert "config.evaluation.sha256" in evaluation.data.tags and "git.commit" in evaluation.data.tags


def test_with_no_judge_configured_the_judge_registered_with_the_challenger_judges(scenario: Scenario) -> None:
    first = result(scenario, "A")
    assert first.judge == JudgeChoice(source="registered", reference=f"models:/{JUDGE}/1")
    assert first.judge_in_sample is False
    tags = scenario.tags_after["A"]["1"]
    assert (tags["promotion.judge"], tags["promotion.judge_source"], tags["promotion.judge_in_sample"]) == (
        f"models:/{JUDGE}/1",
        "registered",
        "false",
    )
    assert scenario.client.get_run(tags["promotion.evaluation_run_id"]).data.metrics["final.judge_in_sample"] == 0.0
    run_id = result(scenario, "B").evaluation_run_id  # A reused the pipeline's run: B's judged the downloads
    assert scenario.client.get_run(run_id).data.metrics["final.judge_in_sample"] == 0.0
    report = json.loads(Path(scenario.client.download_artifacts(run_id, "report.json", str(scenario.root))).read_text())
    downloads = scenario.root / "runs" / ".cache" / "registry"
    assert report["judge"]["name"].startswith(f"reward model {downloads / JUDGE}-v1-")
    assert INDEPENDENT in report["judge"]["description"]  # its training_data.json, rebuilt from its tags
    assert f"judge: independent judge reward model registered with the challenger (models:/{JUDGE}/1)" in (
        scenario.artifacts["A"]["promotion-decision"]
    )


def test_a_failing_challenger_leaves_the_registry_unchanged_and_says_why(scenario: Scenario) -> None:
    second = result(scenario, "B")
    assert (second.decision, second.challenger, second.champion_after) == ("rejected", "2", "1")
    assert second.baseline == "promotion-policy version 1 (champion)"
    assert [check.name for check in second.checks if not check.passed] == ["kl_to_reference"]
    checks = {check.name: check for check in second.checks}  # against the champion and against SFT, both named
    assert (checks["length_ratio"].value, checks["length_ratio_vs_sft"].value) == (1.0, 1.0)
    assert checks["alignment_tax_relative_vs_sft"].passed
    assert "kl_to_reference = 0.9 (<= 0.3): FAIL" in second.message
    assert scenario.champion_after["B"] == "1"
    assert scenario.tags_after["B"] == scenario.tags_after["A"] | {"2": scenario.tags_after["B"]["2"]}
    assert not any(key.startswith("promotion.") for key in scenario.tags_after["B"]["2"])
    assert "rejected" in scenario.artifacts["B"]["promotion-decision"]


def test_a_rejection_is_a_completed_flow_run_named_rejected_with_the_reason(scenario: Scenario) -> None:
    state = scenario.server_states["B"]
    assert (state.type, state.name) == (StateType.COMPLETED, "Rejected")
    assert state.message.startswith("rejected: Version 2 stays the challenger")
    assert "kl_to_reference = 0.9 (<= 0.3): FAIL" in state.message
    assert "kl_to_reference = 0.9 (<= 0.3): FAIL" in scenario.artifacts["B"]["promotion-decision"]
    # under the failed checks, why: the reward models' stage runs are not named here, so their figures are n/a
    why = state.message[state.message.index("Why: ") :]
    assert "policy reward model length-matched accuracy n/a" in why and "evaluation length ratio 1.00" in why
    assert why.split(" Judged")[0].split(" Evaluation:")[0] in scenario.artifacts["B"]["promotion-decision"]
    promoted = scenario.server_states["A"]
    assert (promoted.type, promoted.name) == (StateType.COMPLETED, "Completed")


def test_the_in_sample_judge_is_used_only_when_asked_and_is_flagged(scenario: Scenario) -> None:
    in_sample = result(scenario, "B2")
    assert in_sample.decision == "rejected" and in_sample.champion_after == "1"
    assert in_sample.judge == JudgeChoice(source="in_sample", reference=f"models:/{REWARD}/1")
    assert in_sample.judge_in_sample is True
    assert "Judged IN-SAMPLE: the reward model the challenger was optimised against" in in_sample.message
    assert "**IN-SAMPLE" in scenario.artifacts["B2"]["promotion-decision"]
    evaluation = scenario.client.get_run(in_sample.evaluation_run_id)
    assert evaluation.data.metrics["final.judge_in_sample"] == 1.0
    assert scenario.tags_after["B2"] == scenario.tags_after["B"]  # a rejection changes nothing


def test_a_challenger_without_a_registered_judge_fails_saying_how_to_fix_it(scenario: Scenario) -> None:
    failed = scenario.states["G"]
    assert failed.is_failed()
    message = str(failed.result(raise_on_failure=False))
    assert f"{POLICY} version 3 names no independent judge reward model" in message
    assert "promotion.judge_reward_model" in message and "in_sample" in message
    assert scenario.task_states["G"]["evaluation-inputs"] == "Failed" and "evaluate" not in scenario.task_states["G"]
    assert scenario.champion_after["G"] == "1"
    assert not any(key.startswith("promotion.") for key in scenario.tags_after["G"]["3"])


def test_an_override_without_a_reason_is_refused_before_anything_runs(scenario: Scenario) -> None:
    refused = scenario.states["C"]
    assert refused.is_failed() and "Validation of flow parameters failed" in refused.message
    assert "override needs a reason" in str(refused.result(raise_on_failure=False))
    assert scenario.task_states["C"] == {}
    assert scenario.champion_after["C"] == "1" and scenario.tags_after["C"] == scenario.tags_after["B"]


def test_an_override_with_a_reason_promotes_and_records_the_reason(scenario: Scenario) -> None:
    overridden = result(scenario, "D")
    assert (overridden.decision, overridden.champion_before, overridden.champion_after) == (
        "promoted-by-override",
        "1",
        "2",
    )
    assert scenario.task_states["D"]["evaluate"] == "Cached"  # the same comparison as in B
    assert scenario.calls["D"] == Counter()  # nothing generated or judged again
    assert overridden.checks == result(scenario, "B").checks  # the same verdict
    assert overridden.evaluation_run_id == result(scenario, "B").evaluation_run_id
    assert overridden.evaluation_note is not None and overridden.evaluation_note.startswith("reused the evaluation")
    tags = scenario.tags_after["D"]["2"]
    assert tags[DECISION_TAG] == "promoted-by-override" and tags["promotion.gate"] == "failed"
    assert tags["promotion.override_reason"] == "people preferred it in the human evaluation"
    assert tags[PREVIOUS_CHAMPION_TAG] == "1"
    assert scenario.champion_after["D"] == "2"


def test_rollback_restores_the_previous_champion_and_stops_at_the_first(scenario: Scenario) -> None:
    rolled_back = result(scenario, "E")
    assert (rolled_back.decision, rolled_back.champion_before, rolled_back.champion_after) == ("rolled-back", "2", "1")
    assert scenario.champion_after["E"] == "1"
    demoted = scenario.tags_after["E"]["2"]
    assert (
        demoted[DECISION_TAG] == "rolled-back"
        and demoted["promotion.rollback_reason"] == "complaints after the release"
    )
    assert scenario.tags_after["E"]["1"]["promotion.restored_from"] == "2"

    nothing_earlier = result(scenario, "F")  # a refusal: the flow run completes
    assert (nothing_earlier.decision, nothing_earlier.champion_before, nothing_earlier.champion_after) == (
        "nothing-to-roll-back",
        "1",
        "1",
    )
    assert "version 1 is the first champion: there is no earlier one to restore" in nothing_earlier.message
    assert scenario.champion_after["F"] == "1" and scenario.tags_after["F"] == scenario.tags_after["E"]
    state = scenario.server_states["F"]
    assert (state.type, state.name) == (StateType.COMPLETED, "Nothing to roll back")
    assert "there is no earlier one to restore" in state.message
    assert "nothing-to-roll-back" in scenario.artifacts["F"]["promotion-decision"]


def test_a_policy_identical_to_its_baseline_is_not_evaluated_and_ties(scenario: Scenario) -> None:
    same = result(scenario, "H")
    assert scenario.calls["H"] == Counter() and "evaluate" not in scenario.task_states["H"]
    assert same.evaluation_run_id is None
    assert same.evaluation_note is not None and same.evaluation_note.startswith("identical models, not evaluated")
    assert "identical models, not evaluated" in scenario.artifacts["H"]["promotion-decision"]
    checks = {check.name: check for check in same.checks}
    assert (checks["win_minus_loss_low"].value, checks["lc_win_rate_low"].value) == (0.0, 0.5)  # a tie
    assert same.decision == "rejected" and not checks["lc_win_rate_low"].passed  # 0.5 is not above even
    assert scenario.champion_after["H"] is None


def rlhf_promote_command(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, *args: str
) -> tuple[int, str, str]:
    """`rlhf promote ARGS` with the scenario's settings, through the console entry point: (status, stdout, stderr)."""
    common = settings(Path("runs"))
    options = ["--params", str(common["params_file"]), "-c", str(common["config"][0]), "--runs-dir", "runs"]
    for override in common["overrides"]:
        options += ["-s", override]
    monkeypatch.setattr(sys, "argv", ["rlhf", "promote", *options, *args])  # args last: their -s win
    with pytest.raises(SystemExit) as exit_info:
        main()
    captured = capsys.readouterr()
    return exit_info.value.code or 0, captured.out, captured.err


def test_rlhf_promote_prints_the_decision_and_exits_3_on_a_refusal(
    scenario: Scenario,
    mlflow_server: str,
    prefect_api: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The CLI runs the flow: a rollback with nothing earlier and a rejection (of B's pair again, reused) are
    refusals, exit status 3 with the reason; an override without a reason is a usage error before any run."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    monkeypatch.chdir(scenario.root)

    status, stdout, stderr = rlhf_promote_command(capsys, monkeypatch, "--rollback")
    assert status == REFUSED_EXIT_CODE, stderr
    assert f"promotion of {POLICY}: nothing-to-roll-back: {POLICY} version 1 is the first champion" in stdout
    never = "promotion-policy-never-registered"
    status, stdout, stderr = rlhf_promote_command(
        capsys, monkeypatch, "--rollback", "-s", f"tracking.policy_model_name={never}"
    )
    assert status == REFUSED_EXIT_CODE, stderr
    assert f"promotion of {never}: nothing-to-roll-back: {never} has no champion yet: nothing to roll back" in stdout

    scenario.client.set_registered_model_alias(POLICY, CHALLENGER_ALIAS, "2")
    judged = Counter[str]()
    monkeypatch.setattr(evaluate_stage, "judge_pairs", counted(judged, "judge_pairs", evaluate_stage.judge_pairs))
    status, stdout, stderr = rlhf_promote_command(capsys, monkeypatch)
    assert status == REFUSED_EXIT_CODE, stderr
    lines = stdout.splitlines()
    (first,) = [index for index, line in enumerate(lines) if line.startswith(f"promotion of {POLICY}:")]
    assert lines[first].startswith(f"promotion of {POLICY}: rejected: Version 2 stays the challenger")
    assert lines[first + 1].startswith("  evaluation: reused the evaluation of MLflow run") and judged == Counter()
    assert "  kl_to_reference = 0.9 (<= 0.3): FAIL" in lines[first:]
    assert any(line.startswith("  Why: ") for line in lines[first:])
    assert scenario.client.get_registered_model(POLICY).aliases[CHAMPION_ALIAS] == "1"

    status, _, stderr = rlhf_promote_command(capsys, monkeypatch, "--override")
    assert status == 2 and "override needs a reason" in stderr
