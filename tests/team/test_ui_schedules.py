"""Retraining as a team schedules it, in the Prefect UI: the weekly `rlhf-retrain` schedule and the
automation that starts a retrain on `rlhf.data.pushed` are shown, and a person pauses and resumes each with
its switch; the server's schedule and automation follow."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from playwright.sync_api import Locator, Page, expect

from fixtures.team.browser import Screenshots
from fixtures.team.prefect_ui import open_deployment, prefect_client
from fixtures.team.team_stack import TeamStack

# The browser first: without one the tests skip before the team stack starts.
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("browser")]

SCHEDULE_SHOWN = "At 03:00 AM, only on Monday"  # prefect.yaml's "0 3 * * 1" in the UI's words
AUTOMATION = "rlhf-retrain on new data"


def switch_beside(page: Page, shown: Locator) -> Locator:
    """The on/off switch in the smallest block that holds `shown` (the UI gives switches no label)."""
    return page.locator("div").filter(has=shown).filter(has=page.get_by_role("switch")).last.get_by_role("switch")


def flip(page: Page, switch: Locator) -> None:
    """Click `switch` and wait for the server's answer to the change it sends (a PATCH)."""
    with page.expect_response(lambda response: response.request.method == "PATCH" and response.ok):
        switch.click()


def pause_and_resume(page: Page, switch: Locator, active: Callable[[], bool]) -> None:
    """Switch off, then on again, checking the switch and the server's state (`active`) after each."""
    flip(page, switch)
    expect(switch).not_to_be_checked()
    assert not active()
    flip(page, switch)
    expect(switch).to_be_checked()
    assert active()


def schedule_active(team_stack) -> bool:
    with prefect_client(team_stack) as client:
        (schedule,) = client.read_deployment_by_name("rlhf-retrain/rlhf-retrain").schedules
    return schedule.active


def automation_enabled(team_stack) -> bool:
    with prefect_client(team_stack) as client:
        (automation,) = client.read_automations_by_name(AUTOMATION)
    return automation.enabled


def test_the_retrain_schedule_is_shown_and_paused_and_resumed(
    team_stack: TeamStack, prefect_page: Page, screenshots: Screenshots
) -> None:
    open_deployment(prefect_page, team_stack, "rlhf-retrain")
    expect(prefect_page.get_by_role("link", name=AUTOMATION)).to_be_visible()
    switch = switch_beside(prefect_page, prefect_page.get_by_text(SCHEDULE_SHOWN))
    expect(switch).to_be_checked()
    screenshots.take(prefect_page, "prefect-retrain-schedule")
    pause_and_resume(prefect_page, switch, lambda: schedule_active(team_stack))


def test_the_new_data_automation_is_shown_and_paused_and_resumed(
    team_stack: TeamStack, prefect_page: Page, screenshots: Screenshots
) -> None:
    prefect_page.goto(f"{team_stack.prefect_ui_url}/automations")
    expect(prefect_page.get_by_text("Retrain when `rlhf data add` pushes a new version")).to_be_visible()
    switch = switch_beside(prefect_page, prefect_page.get_by_role("link", name=AUTOMATION))
    expect(switch).to_be_checked()
    screenshots.take(prefect_page, "prefect-retrain-automation")
    pause_and_resume(prefect_page, switch, lambda: automation_enabled(team_stack))
