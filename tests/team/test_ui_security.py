"""Without credentials neither web UI shows anything of the team's: the MLflow UI answers 401 and asks
for a user name and password (HTTP basic auth), the Prefect UI stays on its login page, whose requests
the server refuses with 401; a wrong auth string there is refused too."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from playwright.sync_api import Error, Page, expect

from fixtures.team.browser import Screenshots
from fixtures.team.team_stack import TeamStack

# The browser first: without one the tests skip before the team stack starts.
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("browser")]


def test_mlflow_ui_refuses_a_browser_without_credentials(team_stack: TeamStack, new_page: Callable[..., Page]) -> None:
    """With no credentials a person's browser asks for them; a headless one cannot, and its page load ends
    in Chromium's authentication error instead. With wrong ones the server's 401 page is all there is."""
    anonymous = new_page()
    with pytest.raises(Error, match="ERR_INVALID_AUTH_CREDENTIALS"):
        anonymous.goto(team_stack.mlflow_url)
    answer = anonymous.request.get(f"{team_stack.mlflow_url}/api/2.0/mlflow/registered-models/search")
    assert answer.status == 401 and "Basic" in answer.headers["www-authenticate"]

    user, password = team_stack.mlflow_admin
    wrong = new_page(http_credentials={"username": user, "password": password + "-wrong"})
    assert wrong.goto(team_stack.mlflow_url).status == 401
    expect(wrong.get_by_text("You are not authenticated.")).to_be_visible()
    expect(wrong.get_by_role("link", name="Experiments")).to_have_count(0)


def test_prefect_ui_refuses_a_browser_without_the_auth_string(
    team_stack: TeamStack, new_page: Callable[..., Page], screenshots: Screenshots
) -> None:
    page = new_page()
    with page.expect_response(lambda response: "/api/" in response.url and response.status == 401):
        page.goto(f"{team_stack.prefect_ui_url}/deployments")
    expect(page.get_by_role("heading", name="Login")).to_be_visible()
    expect(page.get_by_role("link", name="rlhf-pipeline")).to_have_count(0)

    page.get_by_role("textbox").fill("admin:not-the-password")
    page.get_by_role("button", name="Login").click()
    expect(page.get_by_text("Authentication failed.").first).to_be_visible()
    expect(page.get_by_role("heading", name="Login")).to_be_visible()
    screenshots.take(page, "prefect-login-refused")
    assert page.request.post(f"{team_stack.prefect_api_url}/deployments/filter", data={}).status == 401
