"""Unit tests of tasks/tracking/metrics_logger.py against an embedded SQLite tracking store (no server)."""

import shutil
from pathlib import Path

import pytest
from mlflow import MlflowClient
from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH

from rlhf_core.training.logger import MetricsLogger
from tasks.tracking.metrics_logger import (
    MlflowLogger,
    flatten_params,
    get_or_create_experiment,
    local_artifact_location,
    resolve_tracking_uri,
    truncate_param_value,
)


@pytest.fixture(scope="module")
def project_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("project")


@pytest.fixture(scope="module")
def client(project_dir: Path, empty_mlflow_db: Path) -> MlflowClient:
    """One SQLite store for the module, a copy of the session's empty one (creating its tables takes seconds)."""
    shutil.copyfile(empty_mlflow_db, project_dir / "mlflow.db")
    return MlflowClient(f"sqlite:///{project_dir / 'mlflow.db'}")


@pytest.fixture
def run_id(client: MlflowClient, project_dir: Path, request: pytest.FixtureRequest) -> str:
    """A fresh run per test, in an experiment whose artifacts live in `<project_dir>/mlruns`."""
    location = local_artifact_location(client.tracking_uri, project_dir)
    experiment_id = get_or_create_experiment(client, "unit-tests", location)
    return client.create_run(experiment_id, run_name=request.node.name).info.run_id


def test_resolve_tracking_uri_prefers_env_then_configured_then_project_sqlite(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://tracking.example:5000")
    assert resolve_tracking_uri("sqlite:///configured.db", tmp_path) == "http://tracking.example:5000"

    monkeypatch.setenv("MLFLOW_TRACKING_URI", "")
    assert resolve_tracking_uri("sqlite:///configured.db", tmp_path) == "sqlite:///configured.db"

    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    assert resolve_tracking_uri("sqlite:///configured.db", tmp_path) == "sqlite:///configured.db"
    assert resolve_tracking_uri(None, tmp_path) == f"sqlite:///{tmp_path.resolve()}/mlflow.db"


def test_default_project_store_is_an_absolute_path_independent_of_cwd(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)
    uri = resolve_tracking_uri(None, Path("project"))
    assert uri == f"sqlite:///{tmp_path.resolve()}/project/mlflow.db"
    assert uri.startswith("sqlite:////")  # four slashes: an absolute path


def test_local_artifact_location_only_for_embedded_sqlite(tmp_path: Path) -> None:
    assert local_artifact_location("sqlite:///x.db", tmp_path) == (tmp_path.resolve() / "mlruns").as_uri()
    assert local_artifact_location("http://127.0.0.1:5000", tmp_path) is None


def test_flatten_params_uses_dotted_keys_and_string_values() -> None:
    params = {"seed": 42, "ppo": {"clip_eps": 0.2, "schedule": {"warmup": 10}}, "tags": [1, 2], "empty": {}}
    assert flatten_params(params) == {
        "seed": "42",
        "ppo.clip_eps": "0.2",
        "ppo.schedule.warmup": "10",
        "tags": "[1, 2]",
        "empty": "{}",
    }


def test_truncate_param_value_cuts_to_the_mlflow_limit_with_a_mark() -> None:
    short = "x" * MAX_PARAM_VAL_LENGTH
    assert truncate_param_value(short) == short
    long = "".join(str(i % 10) for i in range(MAX_PARAM_VAL_LENGTH + 50))
    cut = truncate_param_value(long)
    assert len(cut) == MAX_PARAM_VAL_LENGTH
    assert cut == long[: MAX_PARAM_VAL_LENGTH - 3] + "..."


def test_logger_implements_the_metrics_logger_protocol(client: MlflowClient, run_id: str) -> None:
    assert isinstance(MlflowLogger(run_id, client), MetricsLogger)


def test_log_metrics_records_each_step(client: MlflowClient, run_id: str) -> None:
    logger = MlflowLogger(run_id, client)
    expected = {step: {"loss": 1.0 / (step + 1), "ppo/kl": 0.01 * step} for step in range(4)}
    for step, metrics in expected.items():
        logger.log_metrics(metrics, step=step)
    logger.close()

    for key in ("loss", "ppo/kl"):
        history = sorted(client.get_metric_history(run_id, key), key=lambda m: m.step)
        assert [(m.step, m.value) for m in history] == [(step, expected[step][key]) for step in range(4)]


def test_log_params_flattens_truncates_and_accepts_a_repeat(client: MlflowClient, run_id: str) -> None:
    logger = MlflowLogger(run_id, client)
    params = {"model": {"kind": "tiny", "layers": 2}, "prompt": "p" * (MAX_PARAM_VAL_LENGTH + 10)}
    logger.log_params(params)
    logger.log_params(params)  # a resumed run logs the same values again

    logged = client.get_run(run_id).data.params
    assert logged == {"model.kind": "tiny", "model.layers": "2", "prompt": "p" * (MAX_PARAM_VAL_LENGTH - 3) + "..."}


def test_close_leaves_the_run_open_for_its_owner(client: MlflowClient, run_id: str) -> None:
    MlflowLogger(run_id, client).close()
    assert client.get_run(run_id).info.status == "RUNNING"


def test_artifacts_land_in_the_project_dir_not_the_cwd(
    client: MlflowClient, run_id: str, project_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    source = tmp_path / "notes.txt"
    source.write_text("hello")
    client.log_artifact(run_id, str(source))

    stored = project_dir / "mlruns" / run_id / "artifacts" / "notes.txt"
    assert stored.read_text() == "hello"
    assert not (tmp_path / "mlruns").exists()


def test_get_or_create_experiment_returns_the_existing_one(client: MlflowClient, project_dir: Path) -> None:
    location = local_artifact_location(client.tracking_uri, project_dir)
    first = get_or_create_experiment(client, "twice", location)
    assert get_or_create_experiment(client, "twice", location) == first
    assert client.get_experiment(first).artifact_location == location
