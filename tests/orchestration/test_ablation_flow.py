"""The `rlhf-ablation` flow on a tiny base, run in this process against a real Prefect server (fixture
`prefect_server`) and an embedded SQLite MLflow store.

One module-scoped scenario runs it five times and every test asserts on it:
  first:   the two-variant grid configs/ablations/tiny.yaml: both variants train and are evaluated;
  again:   the same grid again: no variant runs (cache hits), a fresh comparison of both is written;
  added:   the grid plus a third variant: only the third runs;
  failing: the grid plus a variant whose PPO raises and one whose PPO hands on its start (the SFT model,
           not evaluated): the others are compared, then the flow fails;
  bad:     a variant with an unknown key: the flow fails before any task or MLflow run.
(A variant killed mid-run resuming on rerun: tests/orchestration/test_ablation_kill_resume.py.)
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from mlflow import MlflowClient
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, FlowRunFilter, FlowRunFilterId
from prefect.events.worker import EventsWorker
from prefect.logging.handlers import APILogWorker
from prefect.settings import PREFECT_API_URL, temporary_settings
from prefect.states import State

from fixtures.paths import PARAMS, TINY, TINY_GRID
from fixtures.tiny_ppo import save_rm_output, write_stage_inputs
from flows.ablation import AblationResult, AblationSettings, rlhf_ablation
from rlhf_core.ablation.grid import VariantSpec
from rlhf_core.ablation.report import COMPARISON_JSON
from rlhf_core.stage_outputs import directory_sha256
from rlhf_core.stages import ppo as ppo_stage
from tasks.tracking.lineage import FLOW_RUN_ID_TAG
from tasks.tracking.mlflow_runs import ERROR_TAG, PARENT_RUN_TAG

pytestmark = pytest.mark.slow

THIRD = {"name": "ppo_max-no_value_clip", "preset": "ppo_max", "overrides": ["ppo.value_clip=null"]}
FAILING = {"name": "boom", "preset": "ppo_max", "overrides": ["ppo.value_clip=0.1"]}
# With the inverse-CDF draws (the default; the scenario sets multinomial) PPO-max validates best at step 0
# on the tiny base and hands on the SFT model itself.
HANDED_ON_START = {"name": "start", "preset": "ppo_max", "overrides": ["ppo.rollout.sampler=inverse_cdf"]}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
DRAIN_TIMEOUT_S = 10.0


@dataclass
class AblationRun:
    state: State
    task_states: dict[str, str]  # task run name ("ppo[vanilla]", ...) -> final state name
    artifacts: set[str]

    @property
    def result(self) -> AblationResult:
        return self.state.result()


@dataclass
class Scenario:
    root: Path
    client: MlflowClient
    runs: dict[str, AblationRun]
    runs_before_bad: int


def run_and_record(settings: AblationSettings) -> AblationRun:
    state = rlhf_ablation(settings, return_state=True)
    in_run = FlowRunFilter(id=FlowRunFilterId(any_=[state.state_details.flow_run_id]))
    with get_client(sync_client=True) as client:
        task_runs = client.read_task_runs(flow_run_filter=in_run)
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[state.state_details.flow_run_id]))
        )
    return AblationRun(
        state, {run.name: run.state.name for run in task_runs}, {item.key for item in artifacts if item.key}
    )


def write_grid(path: Path, *extra: dict) -> Path:
    """The tiny grid with `extra` variants after its own."""
    variants = [*yaml.safe_load(TINY_GRID.read_text())["variants"], *extra]
    path.write_text(yaml.safe_dump({"name": "tiny", "variants": variants}))
    return path


def failing_for_value_clip_0_1(real_run_ppo):
    """run_ppo that raises for the variant `FAILING` (value_clip 0.1), as a crash of that variant only."""

    def run_ppo(config, *args, **kwargs):
        if config.ppo.value_clip == 0.1:
            raise ValueError("simulated failure of this variant")
        return real_run_ppo(config, *args, **kwargs)

    return run_ppo


def all_runs(client: MlflowClient) -> list:
    experiment = client.get_experiment_by_name("rlhf-pipeline")
    return [] if experiment is None else client.search_runs([experiment.experiment_id])


@pytest.fixture(scope="module")
def scenario(
    tmp_path_factory: pytest.TempPathFactory, prefect_server: str, one_thread: None, tokenizer
) -> Iterator[Scenario]:
    root = tmp_path_factory.mktemp("ablation")
    (root / "base").mkdir()
    write_stage_inputs(root / "base")  # a pipeline run directory: data/, sft/, reward/ ...
    save_rm_output(root / "base" / "judge_reward", tokenizer, seed=2)  # the base's independent judge
    # generate's draws: with them the variants' tiny runs hand on different policies; with the inverse-CDF
    # draws both ppo_max variants validate best at step 0 and hand on the SFT policy, and the second one's
    # evaluation of the same output is (rightly) a cache hit, which is not what these tests are about
    common = {
        "base": str(root / "base"), "config": [str(TINY)],
        "overrides": ["ppo.rollout.sampler=multinomial"],
        "params_file": str(PARAMS), "runs_dir": str(root / "runs"),
    }  # fmt: skip
    uri = f"sqlite:///{root / 'mlflow.db'}"
    with pytest.MonkeyPatch.context() as patch, temporary_settings(updates={PREFECT_API_URL: prefect_server}):
        patch.chdir(root)
        patch.setenv("MLFLOW_TRACKING_URI", uri)
        client = MlflowClient(uri)
        runs = {
            "first": run_and_record(AblationSettings(grid=str(TINY_GRID), **common)),
            "again": run_and_record(AblationSettings(grid=str(TINY_GRID), **common)),
            "added": run_and_record(AblationSettings(grid=str(write_grid(root / "added.yaml", THIRD)), **common)),
        }
        with pytest.MonkeyPatch.context() as crash:
            crash.setattr(ppo_stage, "run_ppo", failing_for_value_clip_0_1(ppo_stage.run_ppo))
            runs["failing"] = run_and_record(
                AblationSettings(grid=str(write_grid(root / "failing.yaml", FAILING, HANDED_ON_START)), **common)
            )
        before = len(all_runs(client))
        bad = [
            VariantSpec(name="fine", preset="vanilla"),
            VariantSpec(name="typo", preset="ppo_max", overrides=["ppo.value_clipp=null"]),
        ]
        runs["bad"] = run_and_record(AblationSettings(variants=bad, **common))
        yield Scenario(root=root, client=client, runs=runs, runs_before_bad=before)
        APILogWorker.drain_all(timeout=DRAIN_TIMEOUT_S)
        EventsWorker.drain_all(timeout=DRAIN_TIMEOUT_S)


def completed(run: AblationRun) -> AblationResult:
    assert run.state.is_completed(), run.state.message
    return run.result


def variant_tasks(run: AblationRun) -> dict[str, str]:
    return {name: state for name, state in run.task_states.items() if name.startswith(("ppo[", "evaluate["))}


def test_a_two_variant_grid_trains_and_evaluates_both(scenario: Scenario) -> None:
    run = scenario.runs["first"]
    result = completed(run)
    assert variant_tasks(run) == {
        "ppo[vanilla]": "Completed", "ppo[ppo_max]": "Completed",
        "evaluate[vanilla]": "Completed", "evaluate[ppo_max]": "Completed",
    }  # fmt: skip
    for variant in result.variants:
        assert variant.ppo.out_dir == result.run_dir / variant.name / "ppo"
        assert variant.evaluation.out_dir == result.run_dir / variant.name / "eval"
    vanilla, ppo_max = (json.loads((item.ppo.out_dir / "metrics.json").read_text()) for item in result.variants)
    assert (
        vanilla["critic_pretrain_steps"] == 0 and ppo_max["critic_pretrain_steps"] >= 1
    )  # the presets, not the base's
    assert {"ablation-summary", "ablation-comparison"} <= run.artifacts
    # the SFT model was sampled once for all the scenario's evaluations: one stored entry per model
    evaluated = completed(scenario.runs["added"]).variants
    assert len(list((scenario.root / "runs" / ".cache" / "replies").iterdir())) == len(evaluated) + 1


def test_a_rerun_runs_no_variant_and_compares_the_cached_outputs(scenario: Scenario) -> None:
    first, again = completed(scenario.runs["first"]), completed(scenario.runs["again"])
    assert set(variant_tasks(scenario.runs["again"]).values()) == {"Cached"}
    assert [item.ppo for item in again.variants] == [item.ppo for item in first.variants]
    assert {item.state for item in again.variants} == {"cached"}
    assert (again.comparison_dir / COMPARISON_JSON).is_file() and again.comparison_dir != first.comparison_dir


def test_an_added_variant_is_the_only_one_that_runs(scenario: Scenario) -> None:
    added = completed(scenario.runs["added"])
    assert variant_tasks(scenario.runs["added"]) == {
        "ppo[vanilla]": "Cached", "ppo[ppo_max]": "Cached", "ppo[ppo_max-no_value_clip]": "Completed",
        "evaluate[vanilla]": "Cached", "evaluate[ppo_max]": "Cached", "evaluate[ppo_max-no_value_clip]": "Completed",
    }  # fmt: skip
    assert [row.variant for row in added.rows] == ["vanilla", "ppo_max", "ppo_max-no_value_clip"]


def test_mlflow_has_a_parent_run_with_the_comparison_and_a_nested_run_per_variant(scenario: Scenario) -> None:
    client, result = scenario.client, completed(scenario.runs["first"])
    parent = client.get_run(result.mlflow_run_id)
    tags = parent.data.tags
    assert parent.info.status == "FINISHED" and tags["rlhf.flow"] == "rlhf-ablation"
    assert tags["base.reference"] == str(scenario.root / "base")
    assert tags["base.sft.sha256"] == directory_sha256(scenario.root / "base" / "sft" / "model")
    assert tags["base.judge-reward.sha256"] == directory_sha256(scenario.root / "base" / "judge_reward" / "model")
    assert {"git.commit", "config.sha256", "prefect.flow_run_id"} <= set(tags)
    artifacts = {item.path for item in client.list_artifacts(parent.info.run_id, "comparison")}
    assert {
        f"comparison/{name}"
        for name in ("comparison.md", "comparison.json", "monitors.png", "outcomes.png", "variants.json")
    } <= artifacts

    children = client.search_runs(
        [parent.info.experiment_id], filter_string=f"tags.`{PARENT_RUN_TAG}` = '{parent.info.run_id}'"
    )
    by_name = {child.info.run_name: child for child in children}
    assert set(by_name) == {"vanilla", "ppo_max", "evaluate[vanilla]", "evaluate[ppo_max]"}
    for variant in result.variants:
        ppo_run = by_name[variant.name]
        assert ppo_run.info.run_id == variant.ppo.mlflow_run_id == tags[f"variant.{variant.name}.ppo.run_id"]
        assert ppo_run.data.tags["rlhf.variant"] == variant.name and ppo_run.data.params["ppo.preset"] == variant.name
        kl = client.get_metric_history(ppo_run.info.run_id, "kl/token_k3")  # the variant's monitors, per iteration
        assert [point.step for point in kl] == list(range(1, int(variant.ppo.metrics["total_steps"]) + 1))
        assert by_name[f"evaluate[{variant.name}]"].info.run_id == variant.evaluation.mlflow_run_id
    assert client.get_metric_history(parent.info.run_id, "vanilla/final_kl")[0].value == result.rows[0].final_kl

    again = client.get_run(completed(scenario.runs["again"]).mlflow_run_id)  # cached variants: linked, not rerun
    assert again.data.tags["variant.vanilla.ppo.run_id"] == by_name["vanilla"].info.run_id
    assert again.data.tags["variant.vanilla.state"] == "cached"


def test_the_comparison_holds_the_numbers_of_each_variants_own_metrics(scenario: Scenario) -> None:
    result = completed(scenario.runs["added"])
    record = json.loads((result.comparison_dir / COMPARISON_JSON).read_text())
    assert [row["variant"] for row in record["rows"]] == ["vanilla", "ppo_max", "ppo_max-no_value_clip"]
    for row, variant in zip(record["rows"], result.variants):
        ppo = json.loads((variant.ppo.out_dir / "metrics.json").read_text())
        judged = json.loads((variant.evaluation.out_dir / "metrics.json").read_text())
        assert row["final_kl"] == ppo["last/kl/token_k3"] and row["selected_kl"] == ppo["val/kl_best"]
        assert row["held_out_gain"] == {
            "mean": ppo["val/reward_gain"],
            "low": ppo["val/reward_gain_low"],
            "high": ppo["val/reward_gain_high"],
        }
        assert row["judge_win_minus_lose"] == {
            "mean": judged["win_minus_loss"],
            "low": judged["win_minus_loss_low"],
            "high": judged["win_minus_loss_high"],
        }
        assert row["ppo_minutes"] == ppo["wall_time_s"] / 60 and row["eval_minutes"] == judged["wall_time_s"] / 60
        assert row["guard_stop_step"] == ppo.get("guard_stop_step") and row["judge_in_sample"] is False
    for name in ("monitors.png", "outcomes.png"):
        assert (result.comparison_dir / name).read_bytes().startswith(PNG_MAGIC)
    markdown = (result.comparison_dir / "comparison.md").read_text()
    assert all(f"| {row['variant']} | " in markdown for row in record["rows"])


def test_a_bad_key_fails_the_flow_naming_the_variant_and_the_key_before_anything_runs(scenario: Scenario) -> None:
    run = scenario.runs["bad"]
    assert run.state.is_failed()
    assert "variant 'typo': ppo.value_clipp: unknown key" in run.state.message and "'fine'" not in run.state.message
    assert run.task_states == {}
    assert len(all_runs(scenario.client)) == scenario.runs_before_bad  # no MLflow run was opened
    assert len(list((scenario.root / "runs" / "ablations").iterdir())) == 4  # no ablation directory either


def test_a_failed_variant_stops_no_other_and_fails_the_flow_after_the_comparison(scenario: Scenario) -> None:
    run = scenario.runs["failing"]
    assert run.state.is_failed() and "variant 'boom' failed" in run.state.message
    assert "simulated failure of this variant" in run.state.message
    assert variant_tasks(run) == {
        "ppo[vanilla]": "Cached", "ppo[ppo_max]": "Cached", "ppo[boom]": "Failed", "ppo[start]": "Completed",
        "evaluate[vanilla]": "Cached", "evaluate[ppo_max]": "Cached",
    }  # fmt: skip
    flow_run_id = str(run.state.state_details.flow_run_id)
    (parent,) = [item for item in all_runs(scenario.client) if item.data.tags.get(FLOW_RUN_ID_TAG) == flow_run_id]
    assert parent.info.status == "FAILED" and "variant 'boom' failed" in parent.data.tags[ERROR_TAG]
    assert parent.data.tags["variant.boom.state"] == "failed" and parent.data.tags["variant.vanilla.state"] == "cached"
    known = {completed(scenario.runs[name]).run_dir for name in ("first", "again", "added")}
    (ablation_dir,) = set((scenario.root / "runs" / "ablations").iterdir()) - known
    rows = {
        row["variant"]: row for row in json.loads((ablation_dir / "comparison" / COMPARISON_JSON).read_text())["rows"]
    }
    assert "simulated failure of this variant" in rows["boom"]["error"] and rows["boom"]["final_kl"] is None
    assert rows["vanilla"]["error"] is None and rows["vanilla"]["judge_win_minus_lose"] is not None


def test_a_variant_that_hands_on_its_start_is_not_evaluated(scenario: Scenario) -> None:
    run = scenario.runs["failing"]
    assert run.task_states["not-evaluated[start]"] == "Completed"
    known = {completed(scenario.runs[name]).run_dir for name in ("first", "again", "added")}
    (ablation_dir,) = set((scenario.root / "runs" / "ablations").iterdir()) - known
    assert json.loads((ablation_dir / "start" / "ppo" / "selection.json").read_text())["chosen_step"] == 0
    assert not (ablation_dir / "start" / "eval" / "generations.jsonl").exists()  # nothing sampled or judged
    rows = {
        row["variant"]: row for row in json.loads((ablation_dir / "comparison" / COMPARISON_JSON).read_text())["rows"]
    }
    assert "identical models, not evaluated" in rows["start"]["not_evaluated"]
    assert rows["start"]["lc_win_rate"] is None and rows["start"]["judge_win_minus_lose"] is None
    markdown = (ablation_dir / "comparison" / "comparison.md").read_text()
    assert "| not evaluated |" in markdown and "`start` not evaluated: identical models, not evaluated" in markdown
