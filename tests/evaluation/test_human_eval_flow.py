"""The `rlhf-human-eval` flow against a real Prefect server (fixture `prefect_api`), answered the way the UI
answers it: the test waits until the run is Paused, reads the form's schema through the API, decides
from what each pair's question shows (its description), and resumes the run with `resume_flow_run(..., run_input=...)`.

One session on four hand-written pairs, with a seed whose recorded order shows pairs 1 and 3 swapped:
- session 1 (a separate process) answers "reply 1" on pairs 1 and 2, then is killed while pair 3's form
  is open: "reply 1" on swapped pair 1 must count for model B;
- session 2 (in this process, two pairs per form) on the same directory asks only pairs 3 and 4, in
  one form, and writes the report: the counts, the verdict file, the Prefect artifact, the MLflow run.
"""

from __future__ import annotations

import contextvars
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from uuid import UUID, uuid4

import pytest
from mlflow import MlflowClient
from prefect import tags
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    ArtifactFilter,
    ArtifactFilterFlowRunId,
    ArtifactFilterKey,
    FlowRunFilter,
    FlowRunFilterTags,
)
from prefect.client.schemas.objects import FlowRun, StateType
from prefect.flow_runs import resume_flow_run
from prefect.input.actions import read_flow_run_input

from fixtures.paths import PARAMS, ROOT
from flows.human_eval import HumanEvalSettings, rlhf_human_eval
from rlhf_core.evaluation.judges.human import PLAN_FILE, as_text, plan_session
from rlhf_core.evaluation.outputs import GeneratedPair, read_generations, read_verdicts, write_jsonl
from tasks.evaluation.human_eval import REPORT_ARTIFACT_KEY, choice_field, comment_field

pytestmark = pytest.mark.slow

SWAPPED = [True, False, True, False]  # the order the seed is chosen for
FORM_TIMEOUT_S = 240.0  # the first form waits for a fresh interpreter to import torch, Prefect and MLflow
POLL_S = 0.25

# Session 1: the flow in a process of its own, so the test can kill it like a crashed worker.
DRIVER = """
import sys
from prefect import tags
from flows.human_eval import HumanEvalSettings, rlhf_human_eval
with tags(sys.argv[2]):
    rlhf_human_eval(HumanEvalSettings.model_validate_json(sys.argv[1]))
"""


def write_pairs(path: Path) -> list[GeneratedPair]:
    """Four pairs in two categories with replies that say which model wrote them."""
    rows = [
        {
            "prompt_id": f"prompt-{index}",
            "category": ("harmless-base", "helpful-base")[index % 2],
            "prompt": [{"role": "user", "content": f"How do I do task {index}?"}],
            "reply_a": f"Model A explains task {index} step by step.",
            "reply_b": f"Model B says task {index} is easy.",
            "tokens_a": 8,
            "tokens_b": 6,
            "finished_a": True,
            "finished_b": True,
        }
        for index in range(1, 5)
    ]
    write_jsonl(path, rows)
    return read_generations(path)


def seed_for(pairs: list[GeneratedPair], wanted: list[bool]) -> int:
    return next(seed for seed in range(1000) if [p.swapped for p in plan_session(pairs, seed).pairs] == wanted)


def settings(out_dir: Path, generations: Path, seed: int, batch_size: int) -> HumanEvalSettings:
    return HumanEvalSettings(
        out_dir=str(out_dir),
        generations=str(generations),
        model_a="ppo",
        model_b="sft",
        seed=seed,
        batch_size=batch_size,
        poll_interval_s=1,
        pause_timeout_s=600,
        params_file=str(PARAMS),
    )


def tagged_run(tag: str) -> FlowRun | None:
    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=[tag])))
    return runs[0] if runs else None


@dataclass(frozen=True)
class OpenForm:
    """A paused run's form as the UI reads it: its JSON schema, a question per pair."""

    run_id: UUID
    key: str  # the schema's key: one per form
    schema: dict[str, Any]

    def questions(self) -> list[str]:
        """The form's questions (its required fields' titles), in order."""
        return [self.schema["properties"][name]["title"] for name in self.schema["required"]]

    def pair_text(self, position: int) -> str:
        """What the form shows with the question about the pair at `position` (its field's description)."""
        return self.schema["properties"][choice_field(position)]["description"]


def wait_for_form(tag: str, answered_keys: set[str], alive: Any) -> OpenForm:
    """The next open form of the run tagged `tag`.

    A form is open once the run is Paused AND its schema is stored: the flow sets the state first and
    saves the form's schema right after, as the UI also has to wait for.
    """
    deadline = time.monotonic() + FORM_TIMEOUT_S
    while time.monotonic() < deadline:
        alive()
        run = tagged_run(tag)
        if run is not None and run.state is not None and run.state.type == StateType.PAUSED:
            keyset = run.state.state_details.run_input_keyset
            if keyset and keyset["schema"] not in answered_keys:
                schema = read_flow_run_input(keyset["schema"], flow_run_id=run.id)
                if schema:
                    return OpenForm(run.id, keyset["schema"], schema)
        time.sleep(POLL_S)
    raise AssertionError(f"no open form for the run tagged {tag} after {FORM_TIMEOUT_S:.0f} s")


def shown_first(form: OpenForm, position: int, pair: GeneratedPair) -> str:
    """ "A" or "B": whose reply the form shows as Reply 1 for the pair at `position` (what a person sees)."""
    reply_1 = form.pair_text(position).split("### Reply 1")[1].split("### Reply 2")[0]
    reply_a, reply_b = as_text(pair.pair.reply_a), as_text(pair.pair.reply_b)  # as the form shows them
    assert (reply_a in reply_1) != (reply_b in reply_1)
    return "A" if reply_a in reply_1 else "B"


def credited(choice: str, first: str) -> str:
    """The verdict a person's choice means, given whose reply they saw first."""
    if choice == "tie":
        return "tie"
    other = "B" if first == "A" else "A"
    return first if choice == "reply 1" else other


@pytest.fixture
def tracking_uri(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    return uri


@dataclass
class Sessions:
    """Two human-evaluation sessions on one output directory, and what their forms showed."""

    pairs: list[GeneratedPair]
    generations: Path
    out_dir: Path
    seed: int
    expected: dict[str, str] = field(default_factory=dict)  # pair key -> verdict, from what the forms showed
    answered: set[str] = field(default_factory=set)


def session_1_killed_at_pair_3(sessions: Sessions, tag: str, log_path: Path) -> None:
    """Pairs 1 and 2 answered in a subprocess's forms, then killed with pair 3's form open."""
    arguments = [sessions.out_dir, sessions.generations, sessions.seed, 1]
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-c", DRIVER, settings(*arguments).model_dump_json(), tag],
            cwd=ROOT,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def alive() -> None:
        if process.poll() is not None:
            raise AssertionError(f"session 1 exited with {process.returncode}:\n{log_path.read_text()[-4000:]}")

    try:
        for position, choice in ((1, "reply 1"), (2, "reply 1")):
            form = wait_for_form(tag, sessions.answered, alive)
            assert form.questions() == [f"Pair {position} of 4: which reply is better?"]
            first = shown_first(form, position, sessions.pairs[position - 1])
            assert first == ("B" if SWAPPED[position - 1] else "A")  # the seeded order, as shown
            resume_flow_run(form.run_id, run_input={choice_field(position): choice, comment_field(position): ""})
            sessions.answered.add(form.key)
            sessions.expected[sessions.pairs[position - 1].pair.pair_key] = credited(choice, first)
        form = wait_for_form(tag, sessions.answered, alive)
        assert form.questions() == ["Pair 3 of 4: which reply is better?"]
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)


def session_2_answers_the_rest(sessions: Sessions, tag: str) -> tuple[UUID, dict[str, Any]]:
    """The same directory, two pairs per form, in this process: only pairs 3 and 4 are asked, in one form.
    Returns the flow run's id and the flow's result."""
    outcome: dict[str, Any] = {}

    def run_session_2() -> None:
        try:
            with tags(tag):
                arguments = (sessions.out_dir, sessions.generations, sessions.seed + 1, 2)
                outcome["metrics"] = rlhf_human_eval(settings(*arguments))
        except Exception as error:  # reported by the test thread
            outcome["error"] = error

    thread = threading.Thread(target=contextvars.copy_context().run, args=(run_session_2,), daemon=True)
    thread.start()

    def alive() -> None:
        if "error" in outcome:
            raise AssertionError(f"session 2 failed: {outcome['error']!r}")

    form = wait_for_form(tag, sessions.answered, alive)
    # pairs 1 and 2 are not asked again
    assert form.questions() == ["Pair 3 of 4: which reply is better?", "Pair 4 of 4: which reply is better?"]
    run_input = {}
    for position, choice in ((3, "reply 2"), (4, "tie")):
        first = shown_first(form, position, sessions.pairs[position - 1])
        run_input |= {choice_field(position): choice, comment_field(position): f"pair {position}"}
        sessions.expected[sessions.pairs[position - 1].pair.pair_key] = credited(choice, first)
    resume_flow_run(form.run_id, run_input=run_input)
    thread.join(timeout=FORM_TIMEOUT_S)
    assert not thread.is_alive() and "error" not in outcome, outcome
    assert tagged_run(tag).state.type == StateType.COMPLETED
    return form.run_id, outcome["metrics"]


def check_tracked(run_id: UUID, tracking_uri: str) -> None:
    """The report artifact of the flow run, and the MLflow run of the human evaluation."""
    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(
                key=ArtifactFilterKey(any_=[REPORT_ARTIFACT_KEY]), flow_run_id=ArtifactFilterFlowRunId(any_=[run_id])
            )
        )
    assert len(artifacts) == 1 and "**Judge:** people (human evaluation): people" in str(artifacts[0].data)
    mlflow_client = MlflowClient(tracking_uri)
    [run] = mlflow_client.search_runs(
        [mlflow_client.get_experiment_by_name("rlhf-pipeline").experiment_id], "tags.`rlhf.stage` = 'human-eval'"
    )
    assert run.data.metrics["win_rate"] == pytest.approx(0.5)
    assert run.data.params["judge"] == "human" and run.data.tags["prefect.flow_run_id"] == str(run_id)
    artifact_paths = {item.path for item in mlflow_client.list_artifacts(run.info.run_id)}
    assert artifact_paths >= {"verdicts.jsonl", "report.md", "plots"}


def test_human_eval_paused_resumed_interrupted_and_resumed(prefect_api: str, tracking_uri: str, tmp_path: Path) -> None:
    generations = tmp_path / "eval" / "generations.jsonl"
    pairs = write_pairs(generations)
    sessions = Sessions(pairs, generations, tmp_path / "human", seed_for(pairs, SWAPPED))
    tag_1, tag_2 = (f"human-eval-test-{uuid4().hex[:8]}" for _ in range(2))
    out_dir = sessions.out_dir

    session_1_killed_at_pair_3(sessions, tag_1, tmp_path / "session1.log")
    assert sessions.expected[pairs[0].pair.pair_key] == "B"  # "reply 1" on the swapped pair credits model B
    assert len((out_dir / "answers.jsonl").read_text().splitlines()) == 2
    run_id, metrics = session_2_answers_the_rest(sessions, tag_2)

    # the report: verdicts as credited, counts, and the same files and formats as the other judges
    judge, verdicts = read_verdicts(out_dir / "verdicts.jsonl")
    assert judge == "human"
    assert {key: verdict.value for key, verdict in verdicts.items()} == sessions.expected
    assert sessions.expected == {
        pairs[0].pair.pair_key: "B",
        pairs[1].pair.pair_key: "A",
        pairs[2].pair.pair_key: "A",
        pairs[3].pair.pair_key: "tie",
    }
    report = json.loads((out_dir / "report.json").read_text())
    assert (report["overall"]["wins"], report["overall"]["ties"], report["overall"]["losses"]) == (2, 1, 1)
    assert report["judge"]["kind"] == "human" and report["judge"]["figures"]["sessions"] == 2
    assert metrics == json.loads((out_dir / "metrics.json").read_text())
    assert json.loads((out_dir / PLAN_FILE).read_text())["seed"] == sessions.seed  # session 2's did not replace it
    answers = [json.loads(line) for line in (out_dir / "answers.jsonl").read_text().splitlines()]
    assert [row["pair_key"] for row in answers] == [pair.pair.pair_key for pair in pairs]
    assert [row["comment"] for row in answers] == ["", "", "pair 3", "pair 4"]
    check_tracked(run_id, tracking_uri)
