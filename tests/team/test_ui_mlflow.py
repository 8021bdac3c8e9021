"""The MLflow UI as a team reads the pipeline in it, on the run started from the Prefect UI
(tests/fixtures/team/ui_pipeline.py): the pipeline's parent run with its stage runs nested under it, a stage's
metric charted over its steps, the plots among its artifacts, and the `rlhf-policy` model with its
versions, aliases and lineage tags on the Models page."""

from __future__ import annotations

import pytest
from mlflow import MlflowClient
from mlflow.entities import Run
from playwright.sync_api import Page, expect

from fixtures.team.browser import Screenshots
from fixtures.team.mlflow_ui import pipeline_parent_run
from fixtures.team.team_stack import TeamStack
from fixtures.team.ui_pipeline import UIPipelineRun

# The browser first: without one the tests skip before the team stack starts.
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("browser")]

POLICY = "rlhf-policy"


def close_assistant(page: Page) -> None:
    """Close the MLflow Assistant side panel, which a fresh browser opens by itself over a third of the
    page (call it once the page has content)."""
    if page.get_by_role("button", name="New Chat").is_visible():
        page.get_by_role("button", name="Close", exact=True).click()


@pytest.fixture
def parent(ui_pipeline_run: UIPipelineRun, mlflow_admin_client: MlflowClient) -> Run:
    return pipeline_parent_run(mlflow_admin_client, ui_pipeline_run.flow_run_id)


def test_the_parent_run_holds_the_stage_runs_with_charts_and_plots(
    parent: Run, mlflow_admin_client: MlflowClient, team_stack: TeamStack, mlflow_page: Page, screenshots: Screenshots
) -> None:
    experiment_id = parent.info.experiment_id
    children = mlflow_admin_client.search_runs(
        [experiment_id], filter_string=f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'"
    )
    assert "register" in {child.info.run_name for child in children}  # stages that ran (not cache hits)
    mlflow_page.goto(f"{team_stack.mlflow_url}/#/experiments/{experiment_id}/runs")
    row = mlflow_page.get_by_role("row").filter(
        has=mlflow_page.get_by_role("link", name=parent.info.run_name, exact=True)
    )
    expect(row).to_be_visible()
    close_assistant(mlflow_page)
    row.get_by_role("button").first.click()  # the expander of the parent's nested runs
    for child in children:
        expect(mlflow_page.get_by_role("link", name=child.info.run_name, exact=True).first).to_be_visible()
    screenshots.take(mlflow_page, "mlflow-nested-runs")

    sft_run_id = parent.data.tags["stage.sft.run_id"]  # this run's, or the cached run's it reused
    mlflow_page.goto(f"{team_stack.mlflow_url}/#/experiments/{experiment_id}/runs/{sft_run_id}/model-metrics")
    mlflow_page.get_by_role("searchbox", name="Search metric charts").fill("loss")  # the charts render lazily
    expect(mlflow_page.get_by_role("heading", name="loss", exact=True)).to_be_visible()
    screenshots.take(mlflow_page, "mlflow-sft-metrics")
    assert len(mlflow_admin_client.get_metric_history(sft_run_id, "loss")) > 1  # a chart over steps

    mlflow_page.get_by_role("tab", name="Artifacts").click()
    mlflow_page.get_by_text("plots", exact=True).first.click()
    expect(mlflow_page.get_by_text("sft_curves.png").first).to_be_visible()
    screenshots.take(mlflow_page, "mlflow-sft-artifacts")
    assert [item.path for item in mlflow_admin_client.list_artifacts(sft_run_id, "plots")] == ["plots/sft_curves.png"]


def test_the_models_page_shows_the_policy_versions_aliases_and_lineage(
    parent: Run, mlflow_admin_client: MlflowClient, team_stack: TeamStack, mlflow_page: Page, screenshots: Screenshots
) -> None:
    model = mlflow_admin_client.get_registered_model(POLICY)
    mlflow_page.goto(f"{team_stack.mlflow_url}/#/models/{POLICY}")
    expect(mlflow_page.get_by_role("link", name="Version 1", exact=True)).to_be_visible()
    close_assistant(mlflow_page)
    for alias, version in model.aliases.items():
        row = mlflow_page.get_by_role("row").filter(
            has=mlflow_page.get_by_role("link", name=f"Version {version}", exact=True)
        )
        expect(row.get_by_role("status", name=alias, exact=True)).to_be_visible()
        tags = mlflow_admin_client.get_model_version(POLICY, version).tags
        lineage = row.get_by_role("status", name="lineage.sft.out_dir", exact=True)
        expect(lineage).to_contain_text(tags["lineage.sft.out_dir"])
        pipeline_run = row.get_by_role("status", name="rlhf.pipeline_run_id", exact=True)
        expect(pipeline_run).to_contain_text(parent.info.run_id)
    screenshots.take(mlflow_page, "mlflow-registry")
    assert "challenger" in model.aliases
