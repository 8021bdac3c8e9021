"""`rlhf run`: the command's options reach the pipeline and it ends by saying where the results are.

Only data preparation runs in the first test (`--stage prepare-data`), against the test Prefect server and an
embedded MLflow store; the training stages through the same flow are covered by test_orchestration_flow.py and
test_orchestration_pipeline.py. The last test runs the whole tiny pipeline as a new user does, in a fresh
process with nothing configured (Prefect's temporary server, a SQLite MLflow store), with stderr in a file,
and reads both.
"""

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import typer
from mlflow import MlflowClient
from typer.testing import CliRunner

from fixtures.commands import RLHF_COMMAND
from fixtures.library_output import library_output, without_quiet_switches
from fixtures.pairs import write_topic_pairs
from fixtures.paths import PARAMS, ROOT, TINY
from rlhf_cli import run_commands

pytestmark = pytest.mark.slow

FRESH_RUN_TIMEOUT_S = 900  # a guard for a hung run, not a measurement
SHORTER = ["-s", "sft.max_steps=2", "-s", "reward.max_steps=2", "-s", "ppo.steps=1", "-s", "evaluation.max_prompts=4"]


def cli() -> typer.Typer:
    """The two commands as rlhf_cli/main.py registers them."""
    app = typer.Typer()
    app.command("run")(run_commands.run)
    app.command("serve")(run_commands.serve)
    return app


def test_run_prints_run_directory_data_version_and_mlflow_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, prefect_api: str
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)  # the embedded default: ./mlflow.db
    data = tmp_path / "pairs.jsonl"
    rows = [{"prompt": f"Question {index}?", "chosen": f"Answer {index}.", "rejected": "No."} for index in range(60)]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))

    result = CliRunner().invoke(
        cli(),
        [
            "run",
            "--params", str(PARAMS),
            "--config", str(TINY),
            "-s", "data.split_salt=cli-test",
            "--data", str(data),
            "--stage", "prepare-data",
            "--runs-dir", "my-runs",
        ],
    )  # fmt: skip

    assert result.exit_code == 0, result.output
    lines = dict(
        line.split(": ", 1) for line in result.output.splitlines() if ": " in line and not line.startswith(" ")
    )
    run_dir = Path(lines["run directory"])
    assert run_dir.parent == tmp_path / "my-runs" and (run_dir / "data" / "data_report.json").is_file()
    assert lines["MLflow tracking URI"] == f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert "mlflow ui --backend-store-uri" in result.output
    assert "registered" not in lines  # register did not run

    client = MlflowClient(lines["MLflow tracking URI"])
    run_id = lines["MLflow run"].split()[0]
    params = client.get_run(run_id).data.params
    assert params["data.split_salt"] == "cli-test" and params["model.kind"] == "tiny"
    assert client.get_run(run_id).data.tags["data.version"] == lines["data version"].split()[0]


def test_run_rejects_an_unknown_stage(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(cli(), ["run", "--params", str(PARAMS), "--stage", "deploy"])
    assert result.exit_code != 0
    assert "'deploy' is not a valid Stage" in str(result.exception)


def test_a_successful_first_run_prints_no_traceback_no_error_and_one_summary(tmp_path: Path) -> None:
    project = tmp_path / "project"
    project.mkdir()
    data = write_topic_pairs(project / "pairs.jsonl", 160)
    env = {key: value for key, value in os.environ.items() if not key.startswith(("PREFECT_", "MLFLOW_"))}
    env = without_quiet_switches(env)
    env |= {"PREFECT_HOME": str(tmp_path / "prefect-home"), "PYTHONPATH": str(ROOT)}
    command = [*RLHF_COMMAND, "run", "--data", str(data)]
    command += ["--params", str(PARAMS), "--config", str(TINY), *SHORTER]

    stderr_file = tmp_path / "stderr.txt"
    with stderr_file.open("w") as stderr:
        result = subprocess.run(
            command, cwd=project, env=env, stdout=subprocess.PIPE, stderr=stderr, text=True,
            timeout=FRESH_RUN_TIMEOUT_S,
        )  # fmt: skip

    terminal = result.stdout + stderr_file.read_text()
    assert result.returncode == 0, terminal[-4000:]
    assert "Traceback" not in terminal
    assert [line for line in terminal.splitlines() if re.search(r"\bERROR\b", line)] == []
    assert terminal.count("run directory: ") == 1 and terminal.count("registered: rlhf-policy version 1") == 1
    assert "Setting accelerator to CPU" not in terminal and "Successfully registered model" not in terminal
    assert library_output(stderr_file.read_text()) == []  # no library bars ("Loading weights", ...) nor notices
    (log_line,) = [line for line in result.stdout.splitlines() if line.startswith("other libraries' messages")]
    log = project / log_line.rsplit(": ", 1)[1]
    assert log.parent == project / "runs" / "logs"
    assert "INFO mlflow: Successfully registered model 'rlhf-policy'." in log.read_text(encoding="utf-8")
