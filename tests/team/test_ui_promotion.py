"""Promotion as a person does it in the Prefect UI, on the challenger the UI-started pipeline run
registered (tests/fixtures/team/ui_pipeline.py): the gate rejects it, the run ends in the "Rejected" state, and
its decision names the failed check; the registry keeps its aliases. An override without a reason is
refused by the form, on the Reason field, and starts nothing; with a reason it moves `champion`."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from mlflow import MlflowClient
from playwright.sync_api import Page, expect

from fixtures.team.browser import Screenshots
from fixtures.team.prefect_ui import (
    add_list_items,
    flow_run_count,
    form_field,
    log_in,
    open_custom_run,
    open_tab,
    prefect_client,
    state_badge,
    submit_run,
    wait_for_final_state,
)
from fixtures.team.team_stack import TeamStack
from fixtures.team.ui_pipeline import STEP_OVERRIDES, TINY_OVERLAY, UIPipelineRun

# The browser first: without one the tests skip before the team stack starts.
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("browser")]

POLICY = "rlhf-policy"
# No tiny policy's length-controlled win rate has a 95% lower bound this high: the gate must reject.
STRICT_GATE = "promotion.min_lc_win_rate_low=0.99"
REASON = "people preferred it in the human evaluation"


def test_a_rejection_names_the_failed_check_and_an_override_needs_a_reason(
    ui_pipeline_run: UIPipelineRun,
    team_stack: TeamStack,
    mlflow_admin_client: MlflowClient,
    new_page: Callable[..., Page],
    screenshots: Screenshots,
) -> None:
    aliases_before = mlflow_admin_client.get_registered_model(POLICY).aliases
    assert "challenger" in aliases_before
    page = new_page()
    log_in(page, team_stack)

    open_custom_run(page, team_stack, "rlhf-promote")
    add_list_items(page, "Config (Optional)", [TINY_OVERLAY])
    add_list_items(page, "Overrides (Optional)", [*STEP_OVERRIDES, STRICT_GATE])
    gated = submit_run(page)
    wait_for_final_state(page)
    expect(state_badge(page)).to_have_text("Rejected")
    open_tab(page, "Artifacts")
    page.get_by_text("promotion-decision", exact=True).first.click()
    expect(page.get_by_role("cell", name="lc_win_rate_low")).to_be_visible()
    expect(page.get_by_role("cell", name="FAIL").first).to_be_visible()
    screenshots.take(page, "prefect-promotion-rejected")
    with prefect_client(team_stack) as client:
        state = client.read_flow_run(gated).state
    assert state.name == "Rejected" and "lc_win_rate_low" in state.message
    assert mlflow_admin_client.get_registered_model(POLICY).aliases == aliases_before

    runs_before = flow_run_count(team_stack, "rlhf-promote")
    open_custom_run(page, team_stack, "rlhf-promote")
    add_list_items(page, "Config (Optional)", [TINY_OVERLAY])
    add_list_items(page, "Overrides (Optional)", STEP_OVERRIDES)
    form_field(page, "Override (Optional)").get_by_role("switch").click()
    page.get_by_role("button", name="Submit").click()
    # The form's rule (flows/promote.py: a reason with something other than white space) as the UI words it.
    expect(form_field(page, "Reason (Optional)").get_by_text("does not match")).to_be_visible()
    screenshots.take(page, "prefect-promotion-override-refused")
    assert flow_run_count(team_stack, "rlhf-promote") == runs_before

    form_field(page, "Reason (Optional)").get_by_role("textbox").fill(REASON)
    overridden = submit_run(page)
    wait_for_final_state(page)
    expect(state_badge(page)).to_have_text("Completed")
    with prefect_client(team_stack) as client:
        assert client.read_flow_run(overridden).state.is_completed()
    challenger = aliases_before["challenger"]
    assert mlflow_admin_client.get_registered_model(POLICY).aliases["champion"] == challenger
    assert REASON in mlflow_admin_client.get_model_version(POLICY, challenger).tags.values()
