"""Imports point one way: rlhf_cli -> flows -> tasks -> rlhf_core, and rlhf_core's packages form no cycle.

Read from the source with `ast` (every import statement, those inside functions too), so a lazy import
that closes a cycle is caught as well as a top-level one.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("rlhf_core", "tasks", "flows", "rlhf_cli")  # each may import only those before it
ORCHESTRATION = ("prefect", "mlflow", "dvc")  # never imported by the ML library


def modules(package: str) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of `package`."""
    found = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imported(path: Path) -> Iterator[str]:
    """Every absolute module name `path` imports."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module


def subpackage(module: str) -> str:
    """rlhf_core.ppo.trainer -> ppo; rlhf_core.config -> config (a top-level module is its own node)."""
    return module.split(".")[1]


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


def test_rlhf_core_modules_form_no_cycle() -> None:
    known = modules("rlhf_core")
    graph = {
        module: {name for name in imported(path) if name in known and name != module}
        for module, path in known.items()
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
