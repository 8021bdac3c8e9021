"""The Run forms of `rlhf-retrain` and `rlhf-ablation` as a person sees them on the team stack: the
settings every training flow shares (flows/run_settings.py) first, in the order the models declare them
(also on PostgreSQL, which reorders a stored schema's keys), then the flow's own; a bad value is refused
on the form, naming the field, and starts nothing."""

from __future__ import annotations

import pytest
from playwright.sync_api import Page, expect

from fixtures.team.browser import Screenshots
from fixtures.team.prefect_ui import form_field, open_custom_run, starts_no_run
from fixtures.team.team_stack import TeamStack

# The browser first: without one the tests skip before the team stack starts.
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("browser")]

SHARED = ["Config", "Overrides", "Params File", "Runs Dir", "Remote", "Stages", "Deployment", "Store"]
RETRAIN = [*SHARED, "Data", "Data Version"]
ABLATION = [*SHARED, "Grid", "Variants", "Only", "Base", "Data", "Sft", "Reward", "Judge"]


def labels(page: Page) -> list[str]:
    """The form's field labels, top to bottom, without the "(Optional)" every one of these carries."""
    shown = page.locator(".schema-form-property__label").all_inner_texts()
    return [label.removesuffix(" (Optional)") for label in shown]


@pytest.mark.parametrize(("deployment", "fields"), [("rlhf-retrain", RETRAIN), ("rlhf-ablation", ABLATION)])
def test_the_form_shows_the_shared_settings_first_in_their_declared_order(
    deployment: str, fields: list[str], team_stack: TeamStack, prefect_page: Page, screenshots: Screenshots
) -> None:
    open_custom_run(prefect_page, team_stack, deployment)
    for field in fields:
        expect(form_field(prefect_page, f"{field} (Optional)")).to_be_visible()
    assert labels(prefect_page) == ["settings", *fields]
    screenshots.take(prefect_page, f"prefect-{deployment}-form")


def test_a_retrain_whose_overrides_are_not_a_list_is_refused_on_the_field(
    team_stack: TeamStack, prefect_page: Page, screenshots: Screenshots
) -> None:
    with starts_no_run(team_stack, "rlhf-retrain"):
        open_custom_run(prefect_page, team_stack, "rlhf-retrain")
        overrides = form_field(prefect_page, "Overrides (Optional)")
        overrides.get_by_role("button").first.click()  # the field's menu
        prefect_page.get_by_role("button", name="Use JSON input").click()
        overrides.get_by_role("textbox").fill('"sft.max_steps=2"')  # one string where a list belongs
        prefect_page.get_by_role("button", name="Submit").click()
        # How the UI words a JSON-typed value of the wrong type, under the field.
        expect(overrides.get_by_text("'sft.max_steps=2' is not valid under any of the given schemas")).to_be_visible()
        screenshots.take(prefect_page, "prefect-retrain-form-refused")


def test_an_ablation_variant_without_a_name_and_preset_is_refused_naming_both(
    team_stack: TeamStack, prefect_page: Page, screenshots: Screenshots
) -> None:
    with starts_no_run(team_stack, "rlhf-ablation"):
        open_custom_run(prefect_page, team_stack, "rlhf-ablation")
        variants = form_field(prefect_page, "Variants (Optional)")
        variants.get_by_role("button", name="Add item").click()
        prefect_page.get_by_role("button", name="Submit").click()
        expect(variants.get_by_text("'name' is a required property")).to_be_visible()
        expect(variants.get_by_text("'preset' is a required property")).to_be_visible()
        screenshots.take(prefect_page, "prefect-ablation-form-refused")
