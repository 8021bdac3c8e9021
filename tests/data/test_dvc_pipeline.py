"""dvc.yaml: loaded with DVC's own loader, checked against the `rlhf` CLI and the project tree, and run.

Stage commands of the stage contract that rlhf_cli/main.py does not have yet (`sft`, `train-rm`, `ppo`)
are checked against the contract's options instead, and their stage modules may still be missing; once
a command exists, it is checked against its real options.
"""

import ast
import json
import os
import shlex
import shutil
import sysconfig
from pathlib import Path

import networkx as nx
import pytest
import typer
import yaml
from click import Command
from dvc.repo import Repo
from dvc.stage import PipelineStage

from fixtures.paths import PARAMS, ROOT
from fixtures.project_repos import copy_project_files, git
from rlhf_cli.data_commands import DEFAULT_RAW_DIR
from rlhf_cli.main import app
from tasks.data.dvc_data import data_version, dvc_add, run_dvc

PIPELINE_FILES = (
    "dvc.yaml",
    "overlays.yaml",
    "params.yaml",
    ".dvc/config",
    ".dvc/.gitignore",
    ".dvcignore",
    ".gitignore",
)
COMMON_OPTIONS = {"--config", "-c", "--set", "-s", "--params", "--out"}
CONTRACT_PENDING_COMMANDS = {
    "sft": COMMON_OPTIONS | {"--data-dir"},
    "train-rm": COMMON_OPTIONS | {"--data-dir", "--sft-dir"},
    "ppo": COMMON_OPTIONS | {"--data-dir", "--sft-dir", "--rm-dir"},
}
CONTRACT_PENDING_FILES = {"rlhf_core/stages/sft.py", "rlhf_core/stages/reward.py", "rlhf_core/stages/ppo.py"}
STAGE_COMMANDS = {
    "prepare_data": "prepare-data",
    "sft": "sft",
    "train_rm": "train-rm",
    "judge_rm": "judge-rm",
    "ppo": "ppo",
}
STAGE_MODULES = {
    "prepare_data": "rlhf_core.stages.prepare_data",
    "sft": "rlhf_core.stages.sft",
    "train_rm": "rlhf_core.stages.reward",
    "judge_rm": "rlhf_core.stages.judge_reward",
    "ppo": "rlhf_core.stages.ppo",
}
STAGE_OUT_DIRS = {
    "prepare_data": "artifacts/data",
    "sft": "artifacts/sft",
    "train_rm": "artifacts/reward",
    "judge_rm": "artifacts/judge_reward",
    "ppo": "artifacts/ppo",
}
UPSTREAM = {
    "prepare_data": set(),
    "sft": {"prepare_data"},
    "train_rm": {"prepare_data", "sft"},
    "judge_rm": {"prepare_data"},
    "ppo": {"prepare_data", "sft", "train_rm"},
}
TINY_OVERLAY = "overlays.yaml:overlay.config=[configs/tiny.yaml]"


def cli_options() -> dict[str, set[str]]:
    """Every `rlhf` subcommand and the option names it accepts, from the typer app itself."""
    group = typer.main.get_command(app)
    commands: dict[str, Command] = group.commands  # type: ignore[attr-defined]
    return {
        name: {option for param in command.params for option in [*param.opts, *param.secondary_opts]}
        for name, command in commands.items()
    }


@pytest.fixture(scope="module")
def loaded_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A git repository holding the project's dvc.yaml and what DVC needs to load it."""
    repo = tmp_path_factory.mktemp("load")
    git(repo, "init", "-q")
    copy_project_files(repo, PIPELINE_FILES)
    return repo


@pytest.fixture(scope="module")
def stages(loaded_repo: Path) -> dict[str, PipelineStage]:
    """The stages of the project's dvc.yaml as DVC loads them (templating resolved), by name."""
    with Repo(str(loaded_repo)) as dvc_repo:
        return {stage.name: stage for stage in dvc_repo.index.stages if isinstance(stage, PipelineStage)}


def test_the_stages_form_the_pipeline_in_order(loaded_repo: Path) -> None:
    with Repo(str(loaded_repo)) as dvc_repo:
        graph = dvc_repo.index.graph  # edges point from a stage to the stages it depends on
        upstream = {
            stage.name: {other.name for other in nx.descendants(graph, stage) if isinstance(other, PipelineStage)}
            for stage in dvc_repo.index.stages
        }
    assert upstream == UPSTREAM


def test_every_stage_runs_its_rlhf_subcommand_with_options_it_accepts(stages: dict[str, PipelineStage]) -> None:
    assert set(stages) == set(STAGE_COMMANDS)
    existing = cli_options()
    for name, stage in stages.items():
        argv = shlex.split(stage.cmd)
        assert argv[:2] == ["rlhf", STAGE_COMMANDS[name]], stage.cmd
        allowed = existing.get(argv[1], CONTRACT_PENDING_COMMANDS.get(argv[1]))
        assert allowed is not None, f"{name}: `rlhf {argv[1]}` is neither a CLI command nor in the contract"
        used = {token for token in argv[2:] if token.startswith("-")}
        assert used <= allowed, f"{name}: options {sorted(used - allowed)} not accepted by `rlhf {argv[1]}`"
        assert argv[argv.index("--out") + 1] == STAGE_OUT_DIRS[name]


def test_prepare_data_reads_the_raw_data_directory_that_data_add_writes(stages: dict[str, PipelineStage]) -> None:
    argv = shlex.split(stages["prepare_data"].cmd)
    assert argv[argv.index("--data") + 1] == DEFAULT_RAW_DIR.as_posix()
    assert DEFAULT_RAW_DIR.as_posix() in {dep.def_path for dep in stages["prepare_data"].deps}


def test_every_path_dependency_exists_or_is_an_upstream_output(stages: dict[str, PipelineStage]) -> None:
    outputs = {name: [out.def_path for out in stage.outs] for name, stage in stages.items()}
    for name, stage in stages.items():
        produced_upstream = [path for other in UPSTREAM[name] for path in outputs[other]]
        for dep in stage.deps:
            if getattr(dep, "params", None) is not None or dep.def_path == DEFAULT_RAW_DIR.as_posix():
                continue  # params are checked below; data/raw is made by `rlhf data add`
            path = dep.def_path
            upstream = any(out == path or out.startswith(path + "/") for out in produced_upstream)
            pending = path in CONTRACT_PENDING_FILES and STAGE_COMMANDS[name] not in cli_options()
            assert (ROOT / path).exists() or upstream or pending, f"{name}: dependency {path} does not exist"


def module_file(name: str) -> Path | None:
    """The file of module `name` in the project, or None when `name` is not a module of it."""
    base = ROOT.joinpath(*name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def imported_rlhf_core_files(module: str) -> set[str]:
    """The files of every rlhf_core module `module` imports, directly or through others, itself included.

    Every import statement counts, also those inside functions (the stages import lazily).
    """
    files: dict[str, Path] = {}
    pending = [module]
    while pending:
        name = pending.pop()
        path = module_file(name)
        if name in files or path is None:  # None: a class or function imported from a module
            continue
        files[name] = path
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
            else:
                continue
            pending.extend(imported for imported in names if imported.split(".")[0] == "rlhf_core")
    return {path.relative_to(ROOT).as_posix() for path in files.values()}


def test_every_stage_depends_on_all_the_code_its_stage_function_imports(stages: dict[str, PipelineStage]) -> None:
    for name, stage in stages.items():
        if module_file(STAGE_MODULES[name]) is None:
            assert STAGE_COMMANDS[name] not in cli_options(), f"{name}: the command exists, its module does not"
            continue  # a stage of the contract that is not written yet
        deps = [dep.def_path for dep in stage.deps]
        uncovered = sorted(
            path
            for path in imported_rlhf_core_files(STAGE_MODULES[name])
            if not any(path == dep or path.startswith(dep + "/") for dep in deps)
        )
        assert uncovered == [], f"{name}: add to its deps in dvc.yaml: {uncovered}"


def test_every_stage_tracks_existing_sections_of_params_yaml(stages: dict[str, PipelineStage]) -> None:
    params = yaml.safe_load((PARAMS).read_text())
    for name, stage in stages.items():
        (params_dep,) = [dep for dep in stage.deps if getattr(dep, "params", None) is not None]
        assert params_dep.def_path == "params.yaml"
        for key in params_dep.params:
            value = params
            for part in key.split("."):
                assert isinstance(value, dict) and part in value, f"{name}: params.yaml has no {key}"
                value = value[part]
        assert "seed" in params_dep.params or name == "prepare_data"


def test_no_stage_output_is_cached_and_everything_lies_in_the_stage_directory(stages: dict[str, PipelineStage]) -> None:
    """DVC versions the raw data only; a fresh clone has no stage output to pull."""
    for name, stage in stages.items():
        for out in stage.outs:
            assert out.def_path.startswith(STAGE_OUT_DIRS[name] + "/"), out.def_path
            assert not out.use_cache, out.def_path
        metrics = [out.def_path for out in stage.outs if out.metric]
        assert metrics == [f"{STAGE_OUT_DIRS[name]}/metrics.json"]
    model_outs = [out.def_path for stage in stages.values() for out in stage.outs if out.def_path.endswith("/model")]
    assert model_outs == [
        "artifacts/sft/model",
        "artifacts/reward/model",
        "artifacts/judge_reward/model",
        "artifacts/ppo/model",
    ]
    assert [out.def_path for stage in stages.values() for out in stage.outs if out.plot] == [
        "artifacts/sft/plots/sft_curves.png",
        "artifacts/reward/plots/reward_margin_hist.png",
        "artifacts/judge_reward/plots/reward_margin_hist.png",
        "artifacts/ppo/plots",
    ]


def write_pairs(path: Path, count: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [
        {"prompt": f"How do I fix problem number {index}?", "chosen": "Carefully, step by step.", "rejected": "No."}
        for index in range(count)
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")


def prepare_data_status(repo: Path) -> dict[str, object]:
    return json.loads(run_dvc(["status", "--json", "prepare_data"], repo) or "{}")


@pytest.mark.slow
def test_dvc_exp_run_applies_the_tiny_overlay_and_params_sections_decide_reruns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q")
    copy_project_files(repo, PIPELINE_FILES)
    shutil.copytree(ROOT / "configs", repo / "configs")
    shutil.copytree(ROOT / "rlhf_core", repo / "rlhf_core", ignore=shutil.ignore_patterns("__pycache__"))
    write_pairs(repo / "data/raw/pairs.jsonl", 40)
    dvc_add(repo / "data/raw")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "project with data")
    # The stage command runs `rlhf`, the console script installed beside this interpreter.
    monkeypatch.setenv("PATH", os.pathsep.join([sysconfig.get_path("scripts"), os.environ["PATH"]]))

    run_dvc(["exp", "run", "-S", TINY_OVERLAY, "prepare_data"], repo)

    lock = yaml.safe_load((repo / "dvc.lock").read_text())["stages"]["prepare_data"]
    assert lock["cmd"] == "rlhf prepare-data --config configs/tiny.yaml --data data/raw --out artifacts/data"
    assert lock["params"]["params.yaml"]["data"]["max_total_tokens"] == 512  # params.yaml; the overlay is on top
    assert {dep["path"]: dep["md5"] for dep in lock["deps"]}["data/raw"] == data_version(repo / "data/raw")
    report = json.loads((repo / "artifacts/data/data_report.json").read_text())
    assert (report["rows_read"], report["settings"]["max_total_tokens"]) == (40, 256)  # configs/tiny.yaml
    assert prepare_data_status(repo) == {}

    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["ppo"]["steps"] = 7  # not a section prepare_data tracks
    (repo / "params.yaml").write_text(yaml.safe_dump(params))
    assert prepare_data_status(repo) == {}
    params["data"]["eval_fraction"] = 0.2
    (repo / "params.yaml").write_text(yaml.safe_dump(params))
    (changed,) = prepare_data_status(repo)["prepare_data"]
    assert changed == {"changed deps": {"params.yaml": {"data": "modified"}}}
