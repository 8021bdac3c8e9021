"""Imports point one way: rlhf_cli -> flows -> tasks -> rlhf_core, and inside rlhf_core and tasks only down
the levels of docs/architecture.md, to the packages its table allows (no sideways import), with no cycle.

Read from the source with `ast` (every import statement, those inside functions too), so a lazy import
that closes a cycle or runs sideways is caught as well as a top-level one. `ALLOWED_IMPORTS` is the
table's twin in code; a test keeps the two equal.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Collection, Iterator, Mapping
from pathlib import Path

import pytest

from fixtures.paths import ROOT

LAYERS = ("rlhf_core", "tasks", "flows", "rlhf_cli")  # each may import only those before it
ORCHESTRATION = ("prefect", "mlflow", "dvc")  # never imported by the ML library
ARCHITECTURE = ROOT / "docs" / "architecture.md"
CORE = "rlhf_core"
TASKS = "tasks"
LEVELLED = (CORE, TASKS)  # the layers whose packages stand on levels of their own
# docs/architecture.md's table: package -> the packages it may import (a layer's name: any of its packages).
ALLOWED_IMPORTS: dict[str, set[str]] = {
    "rlhf_cli": {"flows", "tasks", "rlhf_core"},
    "flows": {"tasks", "rlhf_core"},
    "tasks.ablation": {
        "tasks.evaluation", "tasks.stages", "tasks.registry", "tasks.tracking", "tasks.execution", "rlhf_core",
    },
    "tasks.promotion": {
        "tasks.evaluation", "tasks.stages", "tasks.registry", "tasks.tracking", "tasks.execution", "rlhf_core",
    },
    "tasks.evaluation": {"tasks.stages", "tasks.registry", "tasks.tracking", "tasks.execution", "rlhf_core"},
    "tasks.stages": {"tasks.registry", "tasks.tracking", "tasks.execution", "tasks.data", "rlhf_core"},
    "tasks.registry": {"tasks.tracking", "tasks.serving", "rlhf_core"},
    "tasks.preflight": {"tasks.tracking", "tasks.execution", "tasks.data", "tasks.services", "rlhf_core"},
    "tasks.tracking": {"tasks.execution", "tasks.data", "tasks.services", "rlhf_core"},
    "tasks.execution": {"tasks.services", "rlhf_core"},
    "tasks.data": {"rlhf_core"},
    "tasks.serving": {"rlhf_core"},
    "tasks.services": {"rlhf_core"},
    "ablation": {"stages", "ppo", "config", "atomic", "form_order", "layout"},
    "stages": {
        "evaluation", "ppo", "reward", "sft", "training", "data", "models", "distributed", "config",
        "atomic", "layout", "output_lock", "progress", "statistics", "bf16_probe",
    },
    "evaluation": {
        "reward", "rollout", "sft", "data", "models", "config", "atomic", "layout", "progress", "statistics",
    },
    "ppo": {"rollout", "training", "models", "distributed", "config", "atomic", "progress", "statistics"},
    "reward": {"sft", "data", "models", "config", "atomic", "statistics"},
    "sft": {"data", "models", "atomic", "layout"},
    "rollout": {"models", "config", "c_library", "bf16_probe"},
    "training": {"distributed", "config", "atomic", "c_library", "progress", "bf16_probe"},
    "data": {"config", "atomic", "layout"},
    "models": {"config", "atomic", "progress"},
    "distributed": {"config", "atomic"},
    "config": set(),
    "atomic": {"write_failures"},
    "bf16_probe": {"atomic"},
    "c_library": set(),
    "file_lock": set(),
    "form_order": set(),
    "layout": set(),
    "output_lock": {"file_lock", "write_failures"},
    "progress": set(),
    "statistics": set(),
    "write_failures": set(),
    "promotion": {"config", "stage_outputs"},
    "stage_outputs": {"layout"},
}  # fmt: skip


def modules(package: str, root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of `package` under `root`."""
    found = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imported(path: Path) -> Iterator[str]:
    """Every absolute module name `path` imports (`from tasks import x`: tasks.x, as x may be a module)."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module in LAYERS:
                yield from (f"{node.module}.{alias.name}" for alias in node.names)
            else:
                yield node.module


def subpackage(module: str) -> str:
    """rlhf_core.ppo.trainer -> ppo; rlhf_core.config -> config (a top-level module is its own node)."""
    return module.split(".")[1]


def package_of(module: str) -> str:
    """The table's name for the package holding `module`: rlhf_core.ppo.trainer -> ppo,
    tasks.stages.stage_tasks -> tasks.stages, flows.pipeline -> flows."""
    parts = module.split(".")
    if parts[0] == CORE and len(parts) > 1:
        return parts[1]
    if parts[0] == TASKS and len(parts) > 1:
        return f"{TASKS}.{parts[1]}"
    return parts[0]


def forbidden_imports(allowed: Mapping[str, Collection[str]], root: Path = ROOT) -> list[str]:
    """Every import between the packages of the four layers under `root` that `allowed` does not permit,
    and every package `allowed` has no row for, one line each."""
    offences = []
    for layer in LAYERS:
        for module, path in modules(layer, root).items():
            if module in LEVELLED:
                continue  # rlhf_core/__init__.py, tasks/__init__.py: a layer's root, no package of the table
            source, where = package_of(module), path.relative_to(root)
            if source not in allowed:
                offences.append(f"{where}: package {source} has no row in docs/architecture.md's table")
                continue
            for name in imported(path):
                target = package_of(name)
                layer_of_target = name.split(".")[0]
                if layer_of_target not in LAYERS or target == source:
                    continue
                if target not in allowed[source] and layer_of_target not in allowed[source]:
                    offences.append(f"{where} imports {name}: {source} may not import {target}")
    return offences


def architecture_table(text: str) -> dict[str, set[str]]:
    """docs/architecture.md's package table: package -> the packages of its "may import" cell."""
    table = {}
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 3 and re.fullmatch(r"`[\w.]+`", cells[0]):
            table[cells[0].strip("`")] = set(re.findall(r"`([\w.]+)`", cells[2]))
    return table


def architecture_levels(text: str) -> dict[str, int]:
    """docs/architecture.md's pictures: package -> its level. rlhf_core's lines read "level 3    sft  rollout",
    tasks' "tasks level 2    tracking" (its packages are named `tasks.<name>` in the table)."""
    levels = {}
    for layer, number, names in re.findall(r"^ +(tasks )?level (\d+) +([\w ]+)", text, flags=re.M):
        prefix = f"{TASKS}." if layer else ""
        levels.update({prefix + name: int(number) for name in names.split()})
    return levels


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as a path [a, b, ..., a], or None (depth-first search)."""
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        stack.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == "open":
                return stack[stack.index(target) :] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_cycle_finder_finds_a_cycle_and_accepts_a_dag() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_rlhf_core_packages_form_no_cycle() -> None:
    graph: dict[str, set[str]] = {}
    for module, path in modules("rlhf_core").items():
        if module == "rlhf_core":
            continue
        source = subpackage(module)
        targets = {subpackage(name) for name in imported(path) if name.startswith("rlhf_core.")}
        graph.setdefault(source, set()).update(targets - {source})
    assert find_cycle(graph) is None, f"rlhf_core's packages import each other in a circle: {find_cycle(graph)}"


def test_tasks_packages_form_no_cycle() -> None:
    graph: dict[str, set[str]] = {}
    for module, path in modules(TASKS).items():
        if module == TASKS:
            continue
        targets = {package_of(name) for name in imported(path) if name.startswith(f"{TASKS}.")}
        graph.setdefault(package_of(module), set()).update(targets - {package_of(module)})
    assert find_cycle(graph) is None, f"tasks' packages import each other in a circle: {find_cycle(graph)}"


def test_rlhf_core_modules_form_no_cycle() -> None:
    known = modules("rlhf_core")
    graph = {
        module: {name for name in imported(path) if name in known and name != module} for module, path in known.items()
    }
    assert find_cycle(graph) is None, f"modules import each other in a circle: {find_cycle(graph)}"


@pytest.mark.parametrize("layer", LAYERS)
def test_no_layer_imports_a_layer_above_it(layer: str) -> None:
    above = LAYERS[LAYERS.index(layer) + 1 :]
    forbidden = above + (ORCHESTRATION if layer == "rlhf_core" else ())
    offences = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in modules(layer).values()
        for name in imported(path)
        if name.split(".")[0] in forbidden
    ]
    assert not offences, "\n".join(offences)


def test_the_architecture_table_and_its_twin_in_code_agree() -> None:
    assert architecture_table(ARCHITECTURE.read_text(encoding="utf-8")) == ALLOWED_IMPORTS


def test_the_table_allows_only_imports_down_the_levels_of_the_picture() -> None:
    levels = architecture_levels(ARCHITECTURE.read_text(encoding="utf-8"))
    levelled_packages = set(ALLOWED_IMPORTS) - set(LAYERS)
    assert set(levels) == levelled_packages, "every rlhf_core and tasks package of the table is on one level"
    sideways_or_up = [
        f"{source} -> {target}"
        for source, targets in ALLOWED_IMPORTS.items()
        if source in levels
        for target in targets
        if target not in LAYERS and levels[target] >= levels[source]
    ]
    assert not sideways_or_up, f"the table allows imports that do not go down a level: {sideways_or_up}"


def test_every_import_is_one_the_architecture_table_allows() -> None:
    offences = forbidden_imports(ALLOWED_IMPORTS)
    assert not offences, "\n".join(offences) + "\n(docs/architecture.md says which package may import which)"


def write_module(root: Path, relative: str, source: str = "") -> None:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(source, encoding="utf-8")


def test_the_checker_reports_a_sideways_import_and_a_package_without_a_row(tmp_path: Path) -> None:
    allowed = {"models": {"config"}, "training": {"config"}, "config": set(), "tasks.stages": {"rlhf_core"}}
    write_module(tmp_path, "rlhf_core/__init__.py")
    write_module(tmp_path, "rlhf_core/config/__init__.py")
    write_module(tmp_path, "rlhf_core/models/base.py", "from rlhf_core.config import Config\n")
    write_module(tmp_path, "rlhf_core/models/lora.py", "def f():\n    from rlhf_core.training.freezing import g\n")
    write_module(tmp_path, "rlhf_core/training/freezing.py", "import rlhf_core.config\n")
    write_module(tmp_path, "rlhf_core/sideways/__init__.py")
    write_module(tmp_path, "tasks/stages.py", "import rlhf_core\nfrom rlhf_core.models import base\n")
    assert forbidden_imports(allowed, tmp_path) == [
        "rlhf_core/models/lora.py imports rlhf_core.training.freezing: models may not import training",
        "rlhf_core/sideways/__init__.py: package sideways has no row in docs/architecture.md's table",
    ]


def test_the_checker_reports_an_upward_import_between_layers(tmp_path: Path) -> None:
    allowed = {"tasks.stages": {"rlhf_core"}, "flows": {"tasks", "rlhf_core"}, "ppo": set()}
    write_module(tmp_path, "rlhf_core/ppo/trainer.py", "from tasks import stages\n")
    write_module(tmp_path, "tasks/stages.py", "from flows.pipeline import run\n")
    write_module(tmp_path, "flows/pipeline.py", "from tasks import stages\n")
    assert forbidden_imports(allowed, tmp_path) == [
        "rlhf_core/ppo/trainer.py imports tasks.stages: ppo may not import tasks.stages",
        "tasks/stages.py imports flows.pipeline: tasks.stages may not import flows",
    ]


def test_the_checker_reports_an_import_up_the_levels_of_tasks(tmp_path: Path) -> None:
    allowed = {"tasks.stages": {"tasks.execution", "rlhf_core"}, "tasks.execution": {"rlhf_core"}}
    write_module(tmp_path, "tasks/__init__.py")
    write_module(
        tmp_path, "tasks/stages/stage_tasks.py", "from tasks.execution import caching\nimport rlhf_core.config\n"
    )
    write_module(tmp_path, "tasks/execution/caching.py", "def f():\n    from tasks.stages.stage_tasks import g\n")
    assert forbidden_imports(allowed, tmp_path) == [
        "tasks/execution/caching.py imports tasks.stages.stage_tasks: tasks.execution may not import tasks.stages"
    ]
