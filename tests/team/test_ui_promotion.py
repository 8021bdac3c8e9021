"""Promotion as a person does it in the Prefect UI, on the challenger the UI-started pipeline run
registered (tests/fixtures/team/ui_pipeline.py): the gate rejects it, the run ends in the "Rejected" state, and
its decision names the failed check; the registry keeps its aliases. An override without a reason is
refused by the form, on the Reason field, and starts nothing; with a reason it moves `champion`."""

from __future__ import annotations

import pytest
from mlflow import MlflowClient
from playwright.sync_api import Page, expect

from fixtures.team.browser import Screenshots
from fixtures.team.prefect_ui import (
    add_list_items,
    form_field,
    open_custom_run,
    open_tab,
    prefect_client,
    starts_no_run,
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
    prefect_page: Page,
    screenshots: Screenshots,
) -> None:
    aliases_before = mlflow_admin_client.get_registered_model(POLICY).aliases
    assert "challenger" in aliases_before
    open_custom_run(prefect_page, team_stack, "rlhf-promote")
    add_list_items(prefect_page, "Config (Optional)", [TINY_OVERLAY])
    add_list_items(prefect_page, "Overrides (Optional)", [*STEP_OVERRIDES, STRICT_GATE])
    gated = submit_run(prefect_page)
    wait_for_final_state(prefect_page)
    expect(state_badge(prefect_page)).to_have_text("Rejected")
    open_tab(prefect_page, "Artifacts")
    prefect_page.get_by_text("promotion-decision", exact=True).first.click()
    expect(prefect_page.get_by_role("cell", name="lc_win_rate_low")).to_be_visible()
    expect(prefect_page.get_by_role("cell", name="FAIL").first).to_be_visible()
    screenshots.take(prefect_page, "prefect-promotion-rejected")
    with prefect_client(team_stack) as client:
        state = client.read_flow_run(gated).state
    assert state.name == "Rejected" and "lc_win_rate_low" in state.message
    assert mlflow_admin_client.get_registered_model(POLICY).aliases == aliases_before

    with starts_no_run(team_stack, "rlhf-promote"):
        open_custom_run(prefect_page, team_stack, "rlhf-promote")
        add_list_items(prefect_page, "Config (Optional)", [TINY_OVERLAY])
        add_list_items(prefect_page, "Overrides (Optional)", STEP_OVERRIDES)
        form_field(prefect_page, "Override (Optional)").get_by_role("switch").click()
        prefect_page.get_by_role("button", name="Submit").click()
        # The form's rule (flows/promote.py: a reason with something other than white space) as the UI words it.
        expect(form_field(prefect_page, "Reason (Optional)").get_by_text("does not match")).to_be_visible()
        screenshots.take(prefect_page, "prefect-promotion-override-refused")

    form_field(prefect_page, "Reason (Optional)").get_by_role("textbox").fill(REASON)
    overridden = submit_run(prefect_page)
    wait_for_final_state(prefect_page)
    expect(state_badge(prefect_page)).to_have_text("Completed")
    with prefect_client(team_stack) as client:
        assert client.read_flow_run(overridden).state.is_completed()
    challenger = aliases_before["challenger"]
    assert mlflow_admin_client.get_registered_model(POLICY).aliases["champion"] == challenger
    assert REASON in mlflow_admin_client.get_model_version(POLICY, challenger).tags.values()
