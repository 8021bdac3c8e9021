"""Run the commands of README.md and data/README.md as written, each in a fresh clone, at the tiny scale.

    python3 scripts/readme_commands.py [--doc README.md] [--keep DIR]

A new user copies these commands; this script runs them the way that user would, so that a command
that fails after `rlhf run` shows here first. For each document, in order:
1. `git clone`s this repository's HEAD into a directory of its own and makes `../shared/data` beside
   the clone point at this checkout's, so the Quickstart's data path resolves as written;
2. replaces the clone's params.yaml by the resolved tiny configuration (`rlhf config show -c
   configs/tiny.yaml`): the same commands, on the tiny model, in minutes;
3. reads the document's bash blocks and runs each command line in the clone, in the documented order,
   through bash, with only the documented placeholders filled in (`FILE`, `runs/<id>`; the example
   files my_pairs.jsonl and new-pairs.jsonl are rows of the shared data), long-running servers
   (BACKGROUND) started in the background and waited for, and the reason printed for each line not
   run (SKIPPED);
4. prints one line per command (ok / FAILED / - for not run, seconds) and ends with status 1 if any
   failed.

data/README.md starts with the fresh-clone DVC path (`rlhf data status`, a plain `dvc pull`,
`dvc status`), then adds data, pulls it by target, and runs `dvc repro --dry prepare_data`,
`dvc repro` and the experiments: so this script checks, in a fresh clone, that each of them exits 0
in that order.

Not run: the install and test-suite lines (the CI's job), the S3 lines with the reader's own bucket
(tests/data/test_dvc_data_add.py runs them on an rclone S3 server), and infra/README.md's compose stack (it
needs a Docker daemon). Promotion is the UI's Run button in the README; here it is the same deployment
run with `prefect deployment run`.
"""

from __future__ import annotations

import argparse
import gzip
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
QUICKSTART_DATA = "../shared/data/hh-rlhf-harmless/pairs-1800.jsonl.gz"
# Lines not run, and why.
SKIPPED = {
    "pip install": "the install: what CI does before the suite",
    "python3 -m pytest": "the test suite: what CI runs",
    "dvc remote add s3": "the reader's own S3 remote (placeholders); tests/data/test_dvc_data_add.py runs "
    "these on rclone S3",
    "dvc remote modify": "the reader's own S3 remote (placeholders)",
    "export AWS_": "the reader's own S3 credentials (placeholders)",
    "rlhf data add new-pairs.jsonl --remote s3": "the reader's own S3 remote",
}
# Servers the READMEs start and leave running: started in the background, ready when the URL answers.
BACKGROUND = {
    "prefect server start": "http://127.0.0.1:4200/api/health",
    "rlhf serve": "http://127.0.0.1:4200/api/deployments/name/rlhf-promote/rlhf-promote",  # registered
    "mlflow ui": "http://127.0.0.1:5000/health",
    "MLFLOW_TRACKING_URI=sqlite:///mlflow.db mlflow models serve": "http://127.0.0.1:5001/ping",
}
# What a command must print besides exiting 0 (curl exits 0 on any HTTP answer; in a fresh clone, which
# has no raw data, `rlhf data status` says to add some first).
EXPECTED_OUTPUT = {"curl ": '"choices"', "rlhf data status": "`rlhf data add FILE`"}
# Commands whose documented answer may be a refusal, and its exit status (rlhf_cli/exit_codes.py):
# `rlhf promote` exits 3 when the gate rejects the challenger or there is nothing to roll back; `rlhf eval`
# of the challenger against the champion exits 3 here, since after the first promotion both are one model.
REFUSAL_STATUS = {"rlhf promote": 3, "rlhf eval --a models:/rlhf-policy@challenger --b models:/rlhf-policy@champion": 3}
NEEDS_CHAMPION = "@champion"  # there is a champion only after the first promotion (the UI's Run of rlhf-promote)
DOCS = ("README.md", "docs/orchestration.md", "data/README.md")
# Rows of the example files. data/README.md's new-pairs.jsonl is the whole raw data its `dvc repro`
# trains on: enough for every tiny stage (the judge reward model trains on a quarter of it).
EXAMPLE_ROWS = {"README.md": 24, "data/README.md": 400}
GIT_IDENTITY = {"NAME": "readme-commands", "EMAIL": "readme-commands@example.com"}  # for data/README.md's commit
COMMAND_TIMEOUT_S = 1800
SERVER_TIMEOUT_S = 180


@dataclass
class Outcome:
    """One documented command as it ran."""

    doc: str
    command: str
    ok: bool | None  # None: not run (skip_reason, or a server started once)
    seconds: float
    detail: str = ""


@dataclass
class Session:
    """The clone, its environment, what earlier commands printed, and the background servers."""

    project: Path
    env: dict[str, str]
    outcomes: list[Outcome] = field(default_factory=list)
    printed: dict[str, str] = field(default_factory=dict)
    servers: list[subprocess.Popen] = field(default_factory=list)
    started: set[str] = field(default_factory=set)  # background commands running
    promoted: bool = False


def bash_commands(doc: Path) -> list[str]:
    """The command lines of the bash blocks of `doc`, comments cut, continuation lines joined."""
    blocks = re.findall(r"```bash\n(.*?)```", doc.read_text(encoding="utf-8"), flags=re.DOTALL)
    lines = []
    for block in blocks:
        joined = block.replace("\\\n", " ")
        for line in joined.splitlines():
            command = re.split(r"\s+#\s", " " + line.strip() + " ", maxsplit=1)[0].strip()
            if command and not command.startswith("#"):
                lines.append(command)
    return lines


def clone_project(root: Path) -> Path:
    """A fresh clone of HEAD under `root`, with `root/shared` pointing at this checkout's shared data."""
    project = root / "project"
    subprocess.run(["git", "clone", "-q", str(REPO), str(project)], check=True)
    if SHARED.is_dir():
        (root / "shared").symlink_to(SHARED)
    return project


def environment(root: Path) -> dict[str, str]:
    """This process's environment without Prefect or MLflow settings: each service is the documented default."""
    env = {key: value for key, value in os.environ.items() if not key.startswith(("PREFECT_", "MLFLOW_", "AWS_"))}
    env |= {"PREFECT_HOME": str(root / "prefect-home"), "HOME": str(root / "home"), "RLHF_QUIET": "1"}
    env |= {f"GIT_{role}_{key}": value for role in ("AUTHOR", "COMMITTER") for key, value in GIT_IDENTITY.items()}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env["PATH"]])
    env["PYTHONPATH"] = str(root / "project")  # the clone's code, not the editable install's checkout
    (root / "home").mkdir()
    return env


def write_tiny_params(session: Session) -> None:
    """params.yaml := the resolved tiny configuration, so every documented command runs at the tiny scale."""
    shown = run(session, ["rlhf", "config", "show", "-c", "configs/tiny.yaml"])
    (session.project / "params.yaml").write_text(shown.stdout, encoding="utf-8")


def write_sample_pairs(session: Session, names: list[str], rows: int) -> None:
    """The READMEs' example files (my_pairs.jsonl, new-pairs.jsonl): the first `rows` shared pairs."""
    with gzip.open(session.project / QUICKSTART_DATA, "rt", encoding="utf-8") as source:
        lines = [next(source) for _ in range(rows)]
    for name in names:
        (session.project / name).write_text("".join(lines), encoding="utf-8")


def run(session: Session, args: list[str], timeout: float = COMMAND_TIMEOUT_S) -> subprocess.CompletedProcess:
    return subprocess.run(
        args, cwd=session.project, env=session.env, capture_output=True, text=True, timeout=timeout, check=False
    )


def fill_placeholders(command: str, session: Session) -> str:
    """The documented placeholders: FILE (a preference file) and runs/<id> (the run `rlhf run` made)."""
    command = re.sub(r"(--data) FILE\b", rf"\1 {QUICKSTART_DATA}", command)
    if "runs/<id>" in command:
        command = command.replace("runs/<id>", session.printed["run directory"])
    return command


def summary_lines(output: str) -> dict[str, str]:
    return dict(line.split(": ", 1) for line in output.splitlines() if ": " in line and not line.startswith(" "))


def run_documented(session: Session, doc: str, command: str) -> None:
    """Run one documented command line (through bash, as a reader would) and record its outcome."""
    filled = fill_placeholders(command, session)
    started = time.monotonic()
    completed = run(session, ["bash", "-c", filled])
    seconds = time.monotonic() - started
    session.printed |= summary_lines(completed.stdout)
    expected = next((text for prefix, text in EXPECTED_OUTPUT.items() if filled.startswith(prefix)), "")
    refusal = next((status for prefix, status in REFUSAL_STATUS.items() if filled.startswith(prefix)), 0)
    ok = completed.returncode in (0, refusal) and expected in completed.stdout
    detail = "" if ok else (completed.stderr + completed.stdout)[-1500:]
    session.outcomes.append(Outcome(doc, filled, ok, seconds, detail))
    report(session.outcomes[-1])


def start_background(session: Session, doc: str, command: str, ready_url: str) -> None:
    """Start a documented server command and wait until `ready_url` answers, SERVER_TIMEOUT_S at most."""
    started = time.monotonic()
    log = open(session.project.parent / f"server-{len(session.servers)}.log", "w")
    process = subprocess.Popen(
        ["bash", "-c", command],
        cwd=session.project,
        env=session.env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    session.servers.append(process)
    session.started.add(command)
    deadline = time.monotonic() + SERVER_TIMEOUT_S
    while process.poll() is None and not answers(ready_url) and time.monotonic() < deadline:
        time.sleep(1)
    ok = process.poll() is None and answers(ready_url)
    detail = "" if ok else Path(log.name).read_text()[-1500:]
    session.outcomes.append(Outcome(doc, command + " &", ok, time.monotonic() - started, detail))
    report(session.outcomes[-1])


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status == 200
    except OSError:
        return False


def promote_through_the_deployment(session: Session) -> None:
    """What the README's "press Run in the UI" does for rlhf-promote: a run of the deployment, waited for."""
    command = (
        "prefect deployment run rlhf-promote/rlhf-promote --watch --params "
        '\'{"settings": {"override": true, "reason": "readme_commands.py: the first champion"}}\''
    )
    run_documented(session, "README.md (the UI's Run of rlhf-promote)", command)
    session.promoted = session.outcomes[-1].ok


def stop_servers(session: Session) -> None:
    for process in session.servers:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGINT)
    for process in session.servers:
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)


def report(outcome: Outcome) -> None:
    status = {True: "ok", False: "FAILED", None: "-"}[outcome.ok]
    print(f"{status:6} {outcome.seconds:6.0f} s  [{outcome.doc}] {outcome.command}", flush=True)
    if outcome.detail:
        print("       " + outcome.detail.replace("\n", "\n       "), flush=True)


def skip_reason(command: str) -> str | None:
    return next((reason for prefix, reason in SKIPPED.items() if command.startswith(prefix)), None)


def server_ready_url(command: str) -> str | None:
    """The URL that answers once the server `command` starts is up; None: not a server command."""
    return next((url for prefix, url in BACKGROUND.items() if command.startswith(prefix)), None)


def run_doc(session: Session, doc: str) -> None:
    """The command lines of `doc` in their order, except: `rlhf serve` runs once, after `prefect server
    start`; right after it, the first promotion; and the lines that need a champion after that."""
    deferred = []
    for command in bash_commands(REPO / doc):
        serving_too_early = command == "rlhf serve" and "prefect server start" not in session.started
        if (reason := skip_reason(command)) is not None:
            note(session, doc, command, f"not run: {reason}")
        elif serving_too_early or command in session.started:
            note(session, doc, command, "run once, after `prefect server start` (README, Prefect UI)")
        elif NEEDS_CHAMPION in command and not session.promoted:
            deferred.append(command)
        elif (url := server_ready_url(command)) is not None:
            start_background(session, doc, command, url)
        else:
            run_documented(session, doc, command)
        if command == "rlhf serve" and command in session.started and not session.promoted:
            promote_through_the_deployment(session)
            for waiting in deferred:
                run_documented(session, doc, waiting)
            deferred.clear()
    for waiting in deferred:
        run_documented(session, doc, waiting)


def note(session: Session, doc: str, command: str, why: str) -> None:
    session.outcomes.append(Outcome(doc, command, None, 0.0, why))
    report(session.outcomes[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", type=Path, help="Work in this directory and keep it (default: a temporary one).")
    parser.add_argument("--doc", action="append", choices=DOCS, help="Only this document (repeatable).")
    options = parser.parse_args()
    root = options.keep or Path(tempfile.mkdtemp(prefix="readme-commands-"))
    outcomes = []
    try:
        for doc in options.doc or DOCS:
            outcomes += run_in_fresh_clone(doc, root / doc.replace("/", "-").removesuffix(".md"))
    finally:
        if options.keep is None:
            shutil.rmtree(root, ignore_errors=True)
    ran = [outcome for outcome in outcomes if outcome.ok is not None]
    failed = [outcome for outcome in ran if not outcome.ok]
    print(
        f"{len(ran) - len(failed)} of {len(ran)} documented commands ran as written "
        f"({len(outcomes) - len(ran)} not run)"
    )
    return 1 if failed else 0


def run_in_fresh_clone(doc: str, root: Path) -> list[Outcome]:
    """`doc`'s commands in a clone of their own: each README is followed from scratch by its reader."""
    root.mkdir(parents=True)
    session = Session(project=clone_project(root), env=environment(root))
    write_tiny_params(session)
    write_sample_pairs(session, ["my_pairs.jsonl", "new-pairs.jsonl"], rows=EXAMPLE_ROWS[doc])
    try:
        run_doc(session, doc)
    finally:
        stop_servers(session)
    return session.outcomes


if __name__ == "__main__":
    sys.exit(main())
