"""Fixtures shared by the whole suite. A test module uses these and the helpers of tests/fixtures/; it
does not define its own copies (tests/project/test_shared_fixtures.py checks).

Real Prefect, MLflow and S3 servers on loopback ports (session-scoped): tests/fixtures/servers.py.
The team stack, a real Chromium for the web-UI tests and the one pipeline run they start in the
Prefect UI are the fixtures of tests/team/ alone: tests/team/conftest.py.
Tiny-model stage inputs and `tiny_config`: tests/fixtures/tiny_ppo.py. The repository's paths (`ROOT`,
`PARAMS`, `TINY`, ...): tests/fixtures/paths.py.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch
from transformers import PreTrainedTokenizerBase
from xdist.scheduler import LoadScopeScheduling

from rlhf_core.models.smollm2 import load_smollm2_tokenizer
from rlhf_core.rollout import kernel_library

if TYPE_CHECKING:
    from mlflow import MlflowClient

    from fixtures.tiny_ppo import StageInputs

pytest_plugins = ["fixtures.servers", "fixtures.infra_files", "fixtures.promotion_scenario"]


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerBase:
    """The real SmolLM2 tokenizer (the tiny models use it too); one per module, so no test sees
    another module's changes to it."""
    return load_smollm2_tokenizer()


@pytest.fixture(scope="session")
def built_inputs(tmp_path_factory: pytest.TempPathFactory) -> StageInputs:
    """The tiny stage inputs, built once for the whole session: `inputs` and `data_dir` hand each module a
    copy, which costs a file copy instead of a data preparation and two model builds."""
    from fixtures.tiny_ppo import write_stage_inputs  # imported here: only sessions that use it pay for it

    return write_stage_inputs(tmp_path_factory.mktemp("built-inputs"))


@pytest.fixture(scope="module")
def inputs(built_inputs: StageInputs, tmp_path_factory: pytest.TempPathFactory) -> StageInputs:
    """What `rlhf ppo` reads (prepared data, tiny SFT and reward-model outputs; the SFT and reward-model
    stages are not run), a copy per module, so that no module sees another's changes to it."""
    from fixtures.tiny_ppo import copy_stage_inputs

    return copy_stage_inputs(built_inputs, tmp_path_factory.mktemp("inputs"))


@pytest.fixture(scope="module")
def data_dir(built_inputs: StageInputs, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """80 HH-style pairs prepared with the tiny config (what `inputs.data_dir` holds), a copy per module."""
    return Path(shutil.copytree(built_inputs.data_dir, tmp_path_factory.mktemp("data") / "data"))


@pytest.fixture(scope="session")
def empty_mlflow_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An SQLite MLflow store with MLflow's tables created, once per session: creating them runs MLflow's
    migrations, a second or more of CPU and many small synced writes per store. `mlflow_db` copies it."""
    from mlflow import MlflowClient  # imported here: MLflow costs seconds to import

    path = tmp_path_factory.mktemp("empty-mlflow") / "mlflow.db"
    MlflowClient(f"sqlite:///{path}").search_experiments()
    return path


@pytest.fixture
def mlflow_db(empty_mlflow_db: Path, tmp_path: Path) -> str:
    """The URI of a fresh SQLite MLflow store at `tmp_path / "mlflow.db"`: a copy of the empty one."""
    shutil.copyfile(empty_mlflow_db, tmp_path / "mlflow.db")
    return f"sqlite:///{tmp_path / 'mlflow.db'}"


@pytest.fixture
def mlflow_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, prefect_api: str) -> MlflowClient:
    """A fresh working directory (tmp_path) with an embedded SQLite MLflow store, for a pipeline run in this
    process against the test Prefect server; returns the store's client."""
    from mlflow import MlflowClient  # imported here: MLflow costs seconds to import

    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    return MlflowClient(uri)


@pytest.fixture(scope="session", autouse=True)
def lean_engine_kernel_built() -> None:
    """The lean engine's C library, built (or loaded from its cache) once before any test: a build runs
    the compiler, a process that a test body without the `slow` mark may not start (below)."""
    kernel_library.library()


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """One intra-op thread for a module of tiny-tensor tests: no time goes to OpenMP hand-offs, which
    dominate on a busy 2-core machine, and in-process results match subprocesses run with
    OMP_NUM_THREADS=1 bit for bit. Opt in with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# Programs the standard library runs to inspect the platform (`platform.architecture` runs `file` on the
# interpreter the first time a library asks): not the test's processes.
PLATFORM_PROBES = {"file", "uname"}


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    """Fail a test that starts a process without the `slow` mark (`-m "not slow"` must stay quick).

    Counts `subprocess.Popen` and `multiprocessing.Process.start` calls made by the test body itself;
    fixtures' processes (the servers) are started outside it.
    """
    started: list[str] = []
    original_popen_init = subprocess.Popen.__init__
    original_process_start = multiprocessing.Process.start

    def popen_init(self: subprocess.Popen, args: Any, *rest: Any, **kwargs: Any) -> None:
        program = args[0] if isinstance(args, (list, tuple)) else str(args).split()[0]
        if Path(str(program)).name not in PLATFORM_PROBES:
            started.append(str(args)[:120])
        original_popen_init(self, args, *rest, **kwargs)

    def process_start(self: multiprocessing.Process) -> None:
        started.append(f"multiprocessing.Process {self.name}")
        original_process_start(self)

    subprocess.Popen.__init__ = popen_init  # type: ignore[method-assign]
    multiprocessing.Process.start = process_start  # type: ignore[method-assign]
    try:
        result = yield  # raises when the test failed: then that failure is the report
    finally:
        subprocess.Popen.__init__ = original_popen_init  # type: ignore[method-assign]
        multiprocessing.Process.start = original_process_start  # type: ignore[method-assign]
    if started and item.get_closest_marker("slow") is None:
        pytest.fail(f"{item.nodeid} starts processes but is not marked slow: {started[0]}", pytrace=False)
    return result


# pytest-xdist (`-n 2`, README's Tests) hands each worker whole modules, so that a module's fixtures (a
# trained tiny pipeline, a pair of work pools) are built once, not once per worker; and all of tests/team/ as
# one unit: the team stack is a fixture of that package, and split over two workers it would start twice (two
# minutes of both cores, two browsers).
TEAM_STACK_UNIT = "tests/team/"


class ModuleScheduling(LoadScopeScheduling):
    """xdist's `loadscope` with tests/team/ as one unit."""

    def _split_scope(self, nodeid: str) -> str:
        module = nodeid.split("::", 1)[0]
        return TEAM_STACK_UNIT if module.startswith(TEAM_STACK_UNIT) else module


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist, each worker's share of the cores, for its own tensors and for the processes its
    tests start (OMP_NUM_THREADS, which the stages' core split starts from): two workers that each take
    every core run twice the threads the machine has, and lose time to OpenMP hand-offs
    (docs/results/test-suite.md). A thread count set by the caller is kept."""
    if not hasattr(config, "workerinput") or "OMP_NUM_THREADS" in os.environ:
        return
    threads = max(1, torch.get_num_threads() // int(config.workerinput["workercount"]))
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> ModuleScheduling:
    """`ModuleScheduling`, its units handed out in collection order: xdist's own reordering by test count
    would put the team tests anywhere, and they go first (below)."""
    config.option.loadscopereorder = False
    return ModuleScheduling(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist, the team stack's tests first: they are one worker's longest unit of work, and
    the other worker takes the rest meanwhile. A serial run keeps the collection order: the team tests come
    near the end, so the stack idles only through the last folder's tests."""

    def in_team(item: pytest.Item) -> bool:
        return item.nodeid.startswith(TEAM_STACK_UNIT)

    outside = [item.nodeid for item in items if "team_stack" in getattr(item, "fixturenames", ()) and not in_team(item)]
    if outside:
        raise pytest.UsageError(f"tests that use the team stack belong in {TEAM_STACK_UNIT}: {outside}")
    if hasattr(config, "workerinput"):  # an xdist worker
        items.sort(key=lambda item: not in_team(item))
