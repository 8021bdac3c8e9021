"""`rlhf run`: the command's options reach the pipeline and it ends by saying where the results are.

Only data preparation runs here (`--stage prepare-data`), against the test Prefect server and an embedded
MLflow store; the training stages through the same flow are covered by test_orchestration_flow.py and
test_orchestration_pipeline.py.
"""

import json
from pathlib import Path

import pytest
import typer
from mlflow import MlflowClient
from typer.testing import CliRunner

from rlhf_cli import run_commands

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]


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
            "--params", str(REPO / "params.yaml"),
            "--config", str(REPO / "configs" / "tiny.yaml"),
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
    result = CliRunner().invoke(cli(), ["run", "--stage", "deploy"])
    assert result.exit_code != 0
    assert "'deploy' is not a valid Stage" in str(result.exception)
