"""Human evaluation as people do it in the Prefect UI, on the pairs the UI-started pipeline run evaluated
(tests/fixtures/team/ui_pipeline.py): `rlhf-human-eval` started from its form, each pause's Resume dialog
read (every pair's conversation and both replies visible on the form itself, however many questions fill
it) and answered, the session finished; its verdicts and report lie in the session folder in the format
of the other judges' files, agree with what was answered, and are the run's `human-eval-report` artifact."""

from __future__ import annotations

import json
from itertools import cycle

import pytest
from playwright.sync_api import Page, expect

from fixtures.team.browser import Screenshots
from fixtures.team.human_eval_ui import (
    asked_positions,
    choose,
    open_resume_dialog,
    pair_is_shown,
    pipeline_eval_dir,
    wait_for_form,
)
from fixtures.team.prefect_ui import (
    add_list_items,
    fill_optional_text,
    form_field,
    open_custom_run,
    open_tab,
    prefect_client,
    state_badge,
    submit_run,
    wait_for_final_state,
)
from fixtures.team.team_stack import TeamStack
from fixtures.team.ui_pipeline import UIPipelineRun
from rlhf_core.evaluation.judges.human import Preference, load_session, pair_question, unswap
from rlhf_core.evaluation.judges.verdicts import Verdict
from rlhf_core.evaluation.outputs import (
    GENERATIONS_FILE,
    MATCHED_GENERATIONS_FILE,
    MATCHED_VERDICTS_FILE,
    VERDICTS_FILE,
    read_verdicts,
)
from rlhf_core.layout import METRICS_FILE
from rlhf_core.stages.evaluate import REPORT_JSON, REPORT_MD

# The browser first: without one the tests skip before the team stack starts.
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("browser")]

# The largest form the flow allows: the more questions fill the dialog, the less room the pairs had.
BATCH_SIZE = 10


def start_session(page: Page, stack: TeamStack, eval_dir: str, session: str) -> None:
    """The rlhf-human-eval form on the evaluation's pairs, with the evaluation's own judge for agreement."""
    open_custom_run(page, stack, "rlhf-human-eval")
    form_field(page, "Out Dir").get_by_role("textbox").fill(session)
    fill_optional_text(page, "Generations (Optional)", f"{eval_dir}/{GENERATIONS_FILE}")
    form_field(page, "Batch Size (Optional)").get_by_role("spinbutton").fill(str(BATCH_SIZE))
    add_list_items(page, "Other Verdicts (Optional)", [f"{eval_dir}/{VERDICTS_FILE}"])


def test_people_read_each_pair_on_the_form_and_their_verdicts_are_reported_like_the_other_judges(
    ui_pipeline_run: UIPipelineRun, team_stack: TeamStack, prefect_page: Page, screenshots: Screenshots
) -> None:
    eval_dir = pipeline_eval_dir(team_stack.project_dir, ui_pipeline_run.flow_run_id)
    session = eval_dir.parent / "human-eval"
    start_session(prefect_page, team_stack, str(eval_dir), str(session))
    flow_run_id = submit_run(prefect_page)

    choices, answered, forms = cycle(list(Preference)), {}, set()
    while (form := wait_for_form(team_stack, flow_run_id, forms)) is not None:
        shown = {pair.planned.position: pair for pair in load_session(team_stack.project_dir / session).shown()}
        dialog = open_resume_dialog(prefect_page)
        for position in asked_positions(dialog):
            question = form_field(prefect_page, pair_question(position, len(shown)), within=dialog)
            pair_is_shown(question, shown[position])
            choice = next(choices)
            choose(prefect_page, question, choice.value)
            answered[shown[position].planned.pair_key] = unswap(choice, shown[position].planned.swapped)
        if not forms:
            screenshots.take(prefect_page, "prefect-human-eval-form")
        dialog.get_by_role("button", name="Submit").click()
        expect(dialog).to_be_hidden()
        forms.add(form)

    wait_for_final_state(prefect_page)
    expect(state_badge(prefect_page)).to_have_text("Completed")
    open_tab(prefect_page, "Artifacts")
    expect(prefect_page.get_by_text("human-eval-report", exact=True).first).to_be_visible()
    with prefect_client(team_stack) as client:
        assert client.read_flow_run(flow_run_id).state.is_completed()
    assert len(answered) == len(shown) and len(forms) == -(-len(shown) // BATCH_SIZE)

    folder, evaluated = team_stack.project_dir / session, team_stack.project_dir / eval_dir
    judge, verdicts = read_verdicts(folder / VERDICTS_FILE)
    other_judge, others = read_verdicts(evaluated / VERDICTS_FILE)  # the same format, the same pairs
    assert judge == "human" and set(verdicts) == set(others)
    if (folder / MATCHED_GENERATIONS_FILE).is_file():
        verdicts |= read_verdicts(folder / MATCHED_VERDICTS_FILE)[1]
    assert verdicts == answered
    assert all((folder / name).is_file() for name in (REPORT_JSON, REPORT_MD))
    metrics = json.loads((folder / METRICS_FILE).read_text())
    assert metrics["judge/answered_pairs"] == len(answered)
    valid = [key for key, verdict in others.items() if verdict is not Verdict.INVALID]
    assert metrics[f"agreement/{other_judge}/pairs"] == len(valid)
