"""`rlhf run` stopped by a signal during a stage, as a real process on Prefect's temporary server.

SIGTERM to the command (as a service manager or `kill` sends it) and Ctrl-C at a terminal (SIGINT to its
whole process group) must each stop it within 10 s with nothing it started left running: no process of
its process group (the temporary server used to stay, re-parented to PID 1) and no listener on the
server's port. The flow run is marked Crashed in the server's database, its log names the stage, the
stage's output is incomplete (no metrics.json), and the same command run again resumes that output and
ends with the same models as a run never interrupted (rlhf_cli/in_process.py).

The bound is the deadline `process.wait` is given, not a measurement.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from fixtures.kill_resume import start_until_checkpoint
from fixtures.pairs import write_topic_pairs
from fixtures.paths import PARAMS, ROOT, TINY
from fixtures.processes import group_processes
from fixtures.servers import seed_prefect_home
from rlhf_core.stage_outputs import COMPLETE_MARKER, directory_sha256

pytestmark = pytest.mark.slow  # whole `rlhf run` processes, each with a Prefect server

STOP_DEADLINE_S = 10  # what the issue asks
START_DEADLINE_S = 600  # guards for a hung run, not measurements
RUN_DEADLINE_S = 900
SERVER_LINE = re.compile(r"Starting temporary server on http://127\.0\.0\.1:(\d+)")
LISTEN_STATE = "0A"  # in /proc/net/tcp


def run_command(data: Path, stage: str, runs_dir: str = "runs") -> list[str]:
    """`rlhf run` up to `stage` on the tiny config, that stage long enough to be stopped in the middle."""
    prefix = "sft" if stage == "sft" else "reward"
    return [
        sys.executable, "-c", "from rlhf_cli.main import main; main()",
        "run",
        "--params", str(PARAMS),
        "--config", str(TINY),
        "-s", f"{prefix}.max_steps=12",
        "-s", f"{prefix}.checkpoint_every=2",
        "--data", str(data),
        "--stage", stage,
        "--runs-dir", runs_dir,
    ]  # fmt: skip


def project_env(project: Path) -> dict[str, str]:
    """Nothing configured but a PREFECT_HOME and an MLflow store of the project's own."""
    env = {key: value for key, value in os.environ.items() if not key.startswith(("PREFECT_", "MLFLOW_"))}
    return env | {
        "PREFECT_HOME": str(project / "prefect-home"),
        "PYTHONPATH": str(ROOT),
        "MLFLOW_TRACKING_URI": f"sqlite:///{project / 'mlflow.db'}",
    }


def listening_ports() -> set[int]:
    """The TCP ports something on this machine listens on."""
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            if state == LISTEN_STATE:
                ports.add(int(local.rsplit(":", 1)[1], 16))
    return ports


def stops_within_deadline(process: subprocess.Popen, signal_number: int, to_group: bool, log: Path) -> int:
    """Send `signal_number` (to the process group when `to_group`, as a terminal's Ctrl-C does) and return
    the exit status, failing the test if the command still runs STOP_DEADLINE_S later."""
    os.killpg(process.pid, signal_number) if to_group else process.send_signal(signal_number)
    try:
        return process.wait(timeout=STOP_DEADLINE_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        pytest.fail(f"rlhf run still ran {STOP_DEADLINE_S} s after {signal_number!r}:\n{log.read_text()[-3000:]}")


def flow_runs(prefect_home: Path) -> list[tuple[str, str, list[str]]]:
    """Each flow run in the temporary server's database, oldest first: id, state type, log messages."""
    with sqlite3.connect(prefect_home / "prefect.db") as database:
        runs = database.execute("SELECT id, state_type FROM flow_run ORDER BY created").fetchall()
        query = "SELECT message FROM log WHERE flow_run_id = ?"
        return [(run_id, state, [row[0] for row in database.execute(query, (run_id,))]) for run_id, state in runs]


def assert_stopped_cleanly(process: subprocess.Popen, status: int, signal_number: int, server_port: int) -> None:
    """Exit status 128 + the signal, no process of the command's group left, its server's port free."""
    assert status == 128 + signal_number
    assert group_processes(process.pid) == []  # the temporary server used to stay, re-parented to PID 1
    assert server_port not in listening_ports()


def assert_marked_crashed(project: Path, *log_starts: str) -> None:
    """The run's one flow run is Crashed on its server, and its log holds a message starting with each of
    `log_starts`; a failure shows the command's output (a stop that overran its deadline says so there)."""
    ((_, state, messages),) = flow_runs(project / "prefect-home")
    assert state == "CRASHED", (project / "killed.log").read_text()[-3000:]
    for start in log_starts:
        assert any(message.startswith(start) for message in messages), messages


def start_and_stop(command: list[str], project: Path, stage_glob: str, signal_number: int, to_group: bool) -> Path:
    """Run `command` until its stage has a checkpoint, stop it with `signal_number`, check that it stopped
    cleanly, and return the stage's output directory."""
    env = project_env(project)
    process, stage_dir = start_until_checkpoint(command, project, env, project / "runs", stage_glob, START_DEADLINE_S)
    log = project / "killed.log"
    server_port = int(SERVER_LINE.search(log.read_text()).group(1))
    assert server_port in listening_ports()  # the server this run started, before the signal
    status = stops_within_deadline(process, signal_number, to_group, log)
    assert_stopped_cleanly(process, status, signal_number, server_port)
    assert not (stage_dir / COMPLETE_MARKER).exists()  # incomplete, by the project's rule
    return stage_dir


def test_sigterm_during_a_stage_stops_within_10_s_leaves_nothing_running_and_the_rerun_resumes(
    tmp_path: Path, prefect_database: Path
) -> None:
    seed_prefect_home(tmp_path / "prefect-home", prefect_database)
    data = write_topic_pairs(tmp_path / "pairs.jsonl", 160)
    command = run_command(data, "reward")
    reward_dir = start_and_stop(command, tmp_path, "*/reward", signal.SIGTERM, to_group=False)
    assert_marked_crashed(tmp_path, "stopped by SIGTERM during stage reward")

    env = project_env(tmp_path)
    rerun = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=RUN_DEADLINE_S)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert f"stage reward: {reward_dir} " in rerun.stdout  # the interrupted output, trained on
    assert json.loads((reward_dir / COMPLETE_MARKER).read_text())["resumed_from"] >= 2

    reference = subprocess.run(
        run_command(data, "reward", "reference-runs"), cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=RUN_DEADLINE_S,
    )  # fmt: skip
    assert reference.returncode == 0, reference.stderr[-3000:]
    (reference_dir,) = (tmp_path / "reference-runs").glob("*/reward")
    for stage in ("sft", "reward"):  # the SFT output is the interrupted run's, a cache hit in the rerun
        resumed, uninterrupted = reward_dir.parent / stage / "model", reference_dir.parent / stage / "model"
        assert directory_sha256(resumed) == directory_sha256(uninterrupted), stage


def test_ctrl_c_at_a_terminal_stops_within_10_s_and_the_flow_run_is_marked_on_its_server(
    tmp_path: Path, prefect_database: Path
) -> None:
    seed_prefect_home(tmp_path / "prefect-home", prefect_database)
    data = write_topic_pairs(tmp_path / "pairs.jsonl", 160)
    start_and_stop(run_command(data, "sft"), tmp_path, "*/sft", signal.SIGINT, to_group=True)
    assert_marked_crashed(tmp_path, "stopped by SIGINT during stage sft")  # the server outlived the Ctrl-C


def test_sigterm_while_the_judge_trains_beside_sft_stops_its_process_too(
    tmp_path: Path, prefect_database: Path
) -> None:
    """The judge reward model trains in a process of its own beside SFT (flows/pipeline.py): SIGTERM to the
    command alone (not its group) must stop that process as well, within the same bound."""
    seed_prefect_home(tmp_path / "prefect-home", prefect_database)
    data = write_topic_pairs(tmp_path / "pairs.jsonl", 160)
    command = [*run_command(data, "sft"), "--stage", "judge-reward", "-s", "reward.max_steps=200"]
    start_and_stop(command, tmp_path, "*/sft", signal.SIGTERM, to_group=False)  # no process of its group left
    assert_marked_crashed(tmp_path, "stopped by SIGTERM during stage sft", "stage 3/3: judge-reward (beside sft)")
