"""The rlhf-promote flow against a real MLflow registry (server with S3 artifacts) and a real Prefect server.

One session-scoped scenario on one policy model (tests/fixtures/promotion.py), and every test
asserts on it. The policy versions name the
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
import sys
from collections import Counter
from pathlib import Path

import pytest
from prefect.states import StateType

import rlhf_core.stages.evaluate as evaluate_stage
from fixtures.promotion_scenario import INDEPENDENT, JUDGE, POLICY, REWARD, Scenario, counted, result, settings
from rlhf_cli.exit_codes import REFUSED_EXIT_CODE
from rlhf_cli.main import main
from rlhf_core.promotion.gate import NO_COLLAPSE_BOUND
from tasks.promotion.promote_tasks import CHAMPION_ALIAS, DECISION_TAG, PREVIOUS_CHAMPION_TAG, JudgeChoice
from tasks.registry.registered_models import CHALLENGER_ALIAS

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]


def test_without_a_champion_the_challenger_is_compared_with_sft_and_promoted_with_evidence(promotion: Scenario) -> None:
    first = result(promotion, "A")
    assert (first.decision, first.challenger, first.champion_before, first.champion_after) == (
        "promoted",
        "1",
        None,
        "1",
    )
    assert first.baseline == f"SFT model of version 1 ({promotion.sft_dir})"
    assert {check.name: check.passed for check in first.checks} == {
        "lc_win_rate_low": True,
        "win_minus_loss_low": True,
        "length_ratio": True,
        "alignment_tax_relative": True,
        "kl_to_reference": True,
        "no_collapse": True,
    }
    assert promotion.champion_after["A"] == "1"
    tags = promotion.tags_after["A"]["1"]
    assert tags[DECISION_TAG] == "promoted" and tags[PREVIOUS_CHAMPION_TAG] == "none"
    assert tags["promotion.gate"] == "passed"
    assert tags["promotion.check.kl_to_reference"] == "kl_to_reference = 0.05 (<= 0.3): pass"
    assert tags["promotion.check.win_minus_loss_low"] == "win_minus_loss_low = 0 (> -0.5): pass"
    assert tags["promotion.check.length_ratio"] == "length_ratio = 1 (in [0.67, 1.5]): pass"
    assert tags["promotion.check.no_collapse"] == f"no_collapse = 0 ({NO_COLLAPSE_BOUND}): pass"
    evaluation = promotion.client.get_run(tags["promotion.evaluation_run_id"])
    assert evaluation.data.metrics["final.tie_rate"] == 1.0  # the same weights: every pair a tie
    assert evaluation.data.metrics["final.score_diff_mean"] == 0.0  # identical replies, identical scores
    report = promotion.artifacts["A"]["promotion-decision"]
    assert (
        "# Promotion of `promotion-policy`: promoted" in report
        and "| kl_to_reference | 0.05 | <= 0.3 | pass |" in report
    )


def test_the_pipelines_evaluation_of_the_same_pair_is_reused_not_judged_again(promotion: Scenario) -> None:
    """The registry copies of the policy and the judge hash as the stage outputs the pipeline evaluated, with the
    same data and settings: A reads P's evaluation back, generating and judging nothing, and says so."""
    assert promotion.calls["P"] == Counter(generate_pairs=1, judge_pairs=1)
    first = result(promotion, "A")
    assert promotion.task_states["A"]["evaluate"] == "Cached"
    assert promotion.calls["A"] == Counter()  # no generation, no judge
    assert first.evaluation_run_id == promotion.pipeline_evaluation.mlflow_run_id
    assert first.evaluation_note is not None and first.evaluation_note.startswith(
        f"reused the evaluation of MLflow run {promotion.pipeline_evaluation.mlflow_run_id}"
    )
    assert "Evaluation: reused the evaluation" in first.message
    assert "- evaluation: reused the evaluation of MLflow run" in promotion.artifacts["A"]["promotion-decision"]
    checks = {check.name: check.value for check in first.checks}
    assert checks["win_minus_loss_low"] == promotion.pipeline_evaluation.metrics["win_minus_loss_low"]
    assert checks["lc_win_rate_low"] == promotion.pipeline_evaluation.metrics["lc_win_rate_low"]


def test_registry_models_in_an_evaluation_run_are_named_by_their_uri(promotion: Scenario) -> None:
    second = result(promotion, "B")
    assert promotion.calls["B"] == Counter(generate_pairs=1, judge_pairs=1)  # a new pair: evaluated
    assert second.evaluation_note is None
    evaluation = promotion.client.get_run(second.evaluation_run_id)
    assert evaluation.data.tags["input.model_a.uri"] == f"models:/{POLICY}/2"
    assert evaluation.data.tags["input.model_b.uri"] == f"models:/{POLICY}/1"
    assert evaluation.data.tags["input.judge.uri"] == f"models:/{JUDGE}/1"
    assert "config.evaluation.sha256" in evaluation.data.tags and "git.commit" in evaluation.data.tags


def test_with_no_judge_configured_the_judge_registered_with_the_challenger_judges(promotion: Scenario) -> None:
    first = result(promotion, "A")
    assert first.judge == JudgeChoice(source="registered", reference=f"models:/{JUDGE}/1")
    assert first.judge_in_sample is False
    tags = promotion.tags_after["A"]["1"]
    assert (tags["promotion.judge"], tags["promotion.judge_source"], tags["promotion.judge_in_sample"]) == (
        f"models:/{JUDGE}/1",
        "registered",
        "false",
    )
    assert promotion.client.get_run(tags["promotion.evaluation_run_id"]).data.metrics["final.judge_in_sample"] == 0.0
    run_id = result(promotion, "B").evaluation_run_id  # A reused the pipeline's run: B's judged the downloads
    assert promotion.client.get_run(run_id).data.metrics["final.judge_in_sample"] == 0.0
    report = json.loads(
        Path(promotion.client.download_artifacts(run_id, "report.json", str(promotion.root))).read_text()
    )
    downloads = promotion.root / "runs" / ".cache" / "registry"
    assert report["judge"]["name"].startswith(f"reward model {downloads / JUDGE}-v1-")
    assert INDEPENDENT in report["judge"]["description"]  # its training_data.json, rebuilt from its tags
    assert (
        f"judge: independent judge reward model registered with the challenger (models:/{JUDGE}/1)"
        in (promotion.artifacts["A"]["promotion-decision"])
    )


def test_a_failing_challenger_leaves_the_registry_unchanged_and_says_why(promotion: Scenario) -> None:
    second = result(promotion, "B")
    assert (second.decision, second.challenger, second.champion_after) == ("rejected", "2", "1")
    assert second.baseline == "promotion-policy version 1 (champion)"
    assert [check.name for check in second.checks if not check.passed] == ["kl_to_reference"]
    checks = {check.name: check for check in second.checks}  # against the champion and against SFT, both named
    assert (checks["length_ratio"].value, checks["length_ratio_vs_sft"].value) == (1.0, 1.0)
    assert checks["alignment_tax_relative_vs_sft"].passed
    assert "kl_to_reference = 0.9 (<= 0.3): FAIL" in second.message
    assert promotion.champion_after["B"] == "1"
    assert promotion.tags_after["B"] == promotion.tags_after["A"] | {"2": promotion.tags_after["B"]["2"]}
    assert not any(key.startswith("promotion.") for key in promotion.tags_after["B"]["2"])
    assert "rejected" in promotion.artifacts["B"]["promotion-decision"]


def test_a_rejection_is_a_completed_flow_run_named_rejected_with_the_reason(promotion: Scenario) -> None:
    state = promotion.server_states["B"]
    assert (state.type, state.name) == (StateType.COMPLETED, "Rejected")
    assert state.message.startswith("rejected: Version 2 stays the challenger")
    assert "kl_to_reference = 0.9 (<= 0.3): FAIL" in state.message
    assert "kl_to_reference = 0.9 (<= 0.3): FAIL" in promotion.artifacts["B"]["promotion-decision"]
    # under the failed checks, why: the reward models' stage runs are not named here, so their figures are n/a;
    # the PPO run's are
    why = state.message[state.message.index("Why: ") :]
    assert "policy reward model length-matched accuracy n/a" in why and "evaluation length ratio 1.00" in why
    assert "reward-length Spearman on the SFT policy's replies -0.30" in why  # the PPO run's own figure
    assert why.split(" Judged")[0].split(" Evaluation:")[0] in promotion.artifacts["B"]["promotion-decision"]
    promoted = promotion.server_states["A"]
    assert (promoted.type, promoted.name) == (StateType.COMPLETED, "Completed")


def test_the_in_sample_judge_is_used_only_when_asked_and_is_flagged(promotion: Scenario) -> None:
    in_sample = result(promotion, "B2")
    assert in_sample.decision == "rejected" and in_sample.champion_after == "1"
    assert in_sample.judge == JudgeChoice(source="in_sample", reference=f"models:/{REWARD}/1")
    assert in_sample.judge_in_sample is True
    assert "Judged IN-SAMPLE: the reward model the challenger was optimised against" in in_sample.message
    assert "**IN-SAMPLE" in promotion.artifacts["B2"]["promotion-decision"]
    evaluation = promotion.client.get_run(in_sample.evaluation_run_id)
    assert evaluation.data.metrics["final.judge_in_sample"] == 1.0
    assert promotion.tags_after["B2"] == promotion.tags_after["B"]  # a rejection changes nothing


def test_a_challenger_without_a_registered_judge_fails_saying_how_to_fix_it(promotion: Scenario) -> None:
    failed = promotion.states["G"]
    assert failed.is_failed()
    message = str(failed.result(raise_on_failure=False))
    assert f"{POLICY} version 3 names no independent judge reward model" in message
    assert "promotion.judge_reward_model" in message and "in_sample" in message
    assert promotion.task_states["G"]["evaluation-inputs"] == "Failed" and "evaluate" not in promotion.task_states["G"]
    assert promotion.champion_after["G"] == "1"
    assert not any(key.startswith("promotion.") for key in promotion.tags_after["G"]["3"])


def test_an_override_without_a_reason_is_refused_before_anything_runs(promotion: Scenario) -> None:
    refused = promotion.states["C"]
    assert refused.is_failed() and "Validation of flow parameters failed" in refused.message
    assert "override needs a reason" in str(refused.result(raise_on_failure=False))
    assert promotion.task_states["C"] == {}
    assert promotion.champion_after["C"] == "1" and promotion.tags_after["C"] == promotion.tags_after["B"]


def test_an_override_with_a_reason_promotes_and_records_the_reason(promotion: Scenario) -> None:
    overridden = result(promotion, "D")
    assert (overridden.decision, overridden.champion_before, overridden.champion_after) == (
        "promoted-by-override",
        "1",
        "2",
    )
    assert promotion.task_states["D"]["evaluate"] == "Cached"  # the same comparison as in B
    assert promotion.calls["D"] == Counter()  # nothing generated or judged again
    assert overridden.checks == result(promotion, "B").checks  # the same verdict
    assert overridden.evaluation_run_id == result(promotion, "B").evaluation_run_id
    assert overridden.evaluation_note is not None and overridden.evaluation_note.startswith("reused the evaluation")
    tags = promotion.tags_after["D"]["2"]
    assert tags[DECISION_TAG] == "promoted-by-override" and tags["promotion.gate"] == "failed"
    assert tags["promotion.override_reason"] == "people preferred it in the human evaluation"
    assert tags[PREVIOUS_CHAMPION_TAG] == "1"
    assert promotion.champion_after["D"] == "2"


def test_rollback_restores_the_previous_champion_and_stops_at_the_first(promotion: Scenario) -> None:
    rolled_back = result(promotion, "E")
    assert (rolled_back.decision, rolled_back.champion_before, rolled_back.champion_after) == ("rolled-back", "2", "1")
    assert promotion.champion_after["E"] == "1"
    demoted = promotion.tags_after["E"]["2"]
    assert (
        demoted[DECISION_TAG] == "rolled-back"
        and demoted["promotion.rollback_reason"] == "complaints after the release"
    )
    assert promotion.tags_after["E"]["1"]["promotion.restored_from"] == "2"

    nothing_earlier = result(promotion, "F")  # a refusal: the flow run completes
    assert (nothing_earlier.decision, nothing_earlier.champion_before, nothing_earlier.champion_after) == (
        "nothing-to-roll-back",
        "1",
        "1",
    )
    assert "version 1 is the first champion: there is no earlier one to restore" in nothing_earlier.message
    assert promotion.champion_after["F"] == "1" and promotion.tags_after["F"] == promotion.tags_after["E"]
    state = promotion.server_states["F"]
    assert (state.type, state.name) == (StateType.COMPLETED, "Nothing to roll back")
    assert "there is no earlier one to restore" in state.message
    assert "nothing-to-roll-back" in promotion.artifacts["F"]["promotion-decision"]


def test_a_policy_identical_to_its_baseline_is_not_evaluated_and_ties(promotion: Scenario) -> None:
    same = result(promotion, "H")
    assert promotion.calls["H"] == Counter() and "evaluate" not in promotion.task_states["H"]
    assert same.evaluation_run_id is None
    assert same.evaluation_note is not None and same.evaluation_note.startswith("identical models, not evaluated")
    assert "identical models, not evaluated" in promotion.artifacts["H"]["promotion-decision"]
    checks = {check.name: check for check in same.checks}
    assert (checks["win_minus_loss_low"].value, checks["lc_win_rate_low"].value) == (0.0, 0.5)  # a tie
    assert same.decision == "rejected" and not checks["lc_win_rate_low"].passed  # 0.5 is not above even
    assert promotion.champion_after["H"] is None


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
    promotion: Scenario,
    mlflow_server: str,
    prefect_api: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The CLI runs the flow: a rollback with nothing earlier and a rejection (of B's pair again, reused) are
    refusals, exit status 3 with the reason; an override without a reason is a usage error before any run."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    monkeypatch.chdir(promotion.root)

    status, stdout, stderr = rlhf_promote_command(capsys, monkeypatch, "--rollback")
    assert status == REFUSED_EXIT_CODE, stderr
    assert f"promotion of {POLICY}: nothing-to-roll-back: {POLICY} version 1 is the first champion" in stdout
    never = "promotion-policy-never-registered"
    status, stdout, stderr = rlhf_promote_command(
        capsys, monkeypatch, "--rollback", "-s", f"tracking.policy_model_name={never}"
    )
    assert status == REFUSED_EXIT_CODE, stderr
    assert f"promotion of {never}: nothing-to-roll-back: {never} has no champion yet: nothing to roll back" in stdout

    promotion.client.set_registered_model_alias(POLICY, CHALLENGER_ALIAS, "2")
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
    assert promotion.client.get_registered_model(POLICY).aliases[CHAMPION_ALIAS] == "1"

    status, _, stderr = rlhf_promote_command(capsys, monkeypatch, "--override")
    assert status == 2 and "override needs a reason" in stderr
