"""The Prefect UI as a person uses it to run the pipeline: the run form of the `rlhf-pipeline` deployment
(the run itself: tests/fixtures/team/ui_pipeline.py), the worker's log, the graph of the completed run and its
artifacts; a form with a bad value is refused in the browser and starts nothing.

Each test checks what the page shows and, through the API, what the server recorded.
"""

from __future__ import annotations

import pytest
from playwright.sync_api import Page, expect

from fixtures.team.browser import Screenshots
from fixtures.team.prefect_ui import form_field, open_custom_run, open_tab, prefect_client, starts_no_run, state_badge
from fixtures.team.team_stack import TeamStack
from fixtures.team.ui_pipeline import UIPipelineRun

# The browser first: without one the tests skip before the team stack starts.
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("browser")]


def test_the_form_starts_a_run_that_a_worker_follows_to_completed(
    ui_pipeline_run: UIPipelineRun, team_stack: TeamStack, prefect_page: Page, screenshots: Screenshots
) -> None:
    prefect_page.goto(ui_pipeline_run.url)
    expect(state_badge(prefect_page)).to_have_text("Completed")
    expect(prefect_page.get_by_text("Worker 'ProcessWorker").first).to_be_visible()  # the Logs tab, open first
    screenshots.take(prefect_page, "prefect-run-completed")
    with prefect_client(team_stack) as client:
        run = client.read_flow_run(ui_pipeline_run.flow_run_id)
    assert run.state.is_completed(), run.state.message
    assert run.work_pool_name == "rlhf-cpu"
    assert run.parameters["settings"]["config"] == ["configs/tiny.yaml"]


def test_the_completed_run_shows_its_stage_summaries_and_evaluation(
    ui_pipeline_run: UIPipelineRun, prefect_page: Page, screenshots: Screenshots
) -> None:
    prefect_page.goto(ui_pipeline_run.url)
    open_tab(prefect_page, "Artifacts")
    for key in ("pipeline-summary", "sft-summary", "reward-summary", "ppo-summary", "evaluate-report"):
        expect(prefect_page.get_by_text(key, exact=True).first).to_be_visible()
    screenshots.take(prefect_page, "prefect-run-artifacts")
    prefect_page.get_by_text("evaluate-report", exact=True).first.click()
    expect(prefect_page.get_by_role("heading", name="Length-controlled result")).to_be_visible()
    expect(prefect_page.get_by_text("Length-controlled win rate of A").first).to_be_visible()
    screenshots.take(prefect_page, "prefect-evaluation-report")


def test_an_out_of_range_number_is_refused_in_the_form_and_starts_nothing(
    team_stack: TeamStack, prefect_page: Page, screenshots: Screenshots
) -> None:
    with starts_no_run(team_stack, "rlhf-human-eval"):
        open_custom_run(prefect_page, team_stack, "rlhf-human-eval")
        form_field(prefect_page, "Batch Size (Optional)").get_by_role("spinbutton").fill("0")
        prefect_page.get_by_role("button", name="Submit").click()
        refusal = prefect_page.get_by_text("Validation failed for field 'settings.batch_size'").first
        expect(refusal).to_be_visible()
        expect(refusal).to_contain_text("0 is less than the minimum of 1")
        expect(prefect_page.get_by_role("button", name="Submit")).to_be_visible()  # still on the form
        screenshots.take(prefect_page, "prefect-form-refused")
