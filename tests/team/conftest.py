"""The fixtures of the team tests (tests/fixtures/team/): the team stack, the browser and the pipeline run
started in the Prefect UI live for this package only (`scope="package"`, which needs the package's
__init__.py), so they stop when its last test ends, not with the session. Under pytest-xdist the worker
that runs this package goes on with other tests, and those would otherwise run beside a whole stack of
servers and a browser, inside Playwright's sync API: its event loop stays current in the main thread while
the browser is open, and Prefect's sync calls there return coroutines instead of results.
"""

from fixtures.team.browser import browser, new_page, pytest_runtest_makereport, screenshots
from fixtures.team.mlflow_ui import mlflow_admin_client, mlflow_page
from fixtures.team.prefect_ui import prefect_page
from fixtures.team.team_stack import team_stack
from fixtures.team.ui_pipeline import ui_pipeline_run

__all__ = [
    "browser",
    "mlflow_admin_client",
    "mlflow_page",
    "new_page",
    "prefect_page",
    "pytest_runtest_makereport",
    "screenshots",
    "team_stack",
    "ui_pipeline_run",
]
