"""Sizes a newcomer can read, for the source and the tests alike: no package (folder of Python files) above
25 modules, no file above 450 lines, no function or method above 60 lines (decorators to last line,
docstring included). Read from the source with `ast`, so nothing is imported.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from fixtures.paths import ROOT

SOURCE_DIRS = ("rlhf_core", "tasks", "flows", "rlhf_cli", "benchmarks", "scripts", "infra", "tests")
MAX_MODULES_PER_PACKAGE = 25
MAX_FILE_LINES = 450
MAX_FUNCTION_LINES = 60


def source_files() -> Iterator[Path]:
    """Every Python file of the project, tests included, skipping hidden folders (a benchmark's venv)."""
    for top in SOURCE_DIRS:
        for path in sorted((ROOT / top).rglob("*.py")):
            if not any(part.startswith(".") for part in path.relative_to(ROOT).parts):
                yield path


def long_functions(path: Path) -> Iterator[str]:
    """`file:line name (N lines)` for each function in `path` longer than MAX_FUNCTION_LINES."""
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            first = min([node.lineno] + [decorator.lineno for decorator in node.decorator_list])
            lines = node.end_lineno - first + 1
            if lines > MAX_FUNCTION_LINES:
                yield f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)"


def test_the_source_is_found() -> None:
    files = list(source_files())
    assert ROOT / "rlhf_core" / "stages" / "sft.py" in files and ROOT / "tests" / "conftest.py" in files
    assert len(files) > 100


def packages() -> Iterator[Path]:
    """Every folder of SOURCE_DIRS that holds Python files, the tops included, skipping hidden ones and caches."""
    for top in SOURCE_DIRS:
        for folder in [ROOT / top, *sorted((ROOT / top).rglob("*"))]:
            hidden = any(part.startswith(".") for part in folder.relative_to(ROOT).parts)
            if folder.is_dir() and folder.name != "__pycache__" and not hidden and any(folder.glob("*.py")):
                yield folder


def test_every_package_is_found() -> None:
    found = {str(folder.relative_to(ROOT)) for folder in packages()}
    assert {"rlhf_core/ppo", "tasks/stages", "flows", "tests/ppo", "tests/fixtures"} <= found


def test_no_package_holds_more_than_25_modules() -> None:
    crowded = {
        str(package.relative_to(ROOT)): count
        for package in packages()
        if (count := len(list(package.glob("*.py")))) > MAX_MODULES_PER_PACKAGE
    }
    assert crowded == {}


def test_no_source_file_is_longer_than_450_lines() -> None:
    long_files = {
        str(path.relative_to(ROOT)): lines
        for path in source_files()
        if (lines := len(path.read_text().splitlines())) > MAX_FILE_LINES
    }
    assert long_files == {}


def test_no_function_is_longer_than_60_lines() -> None:
    assert [found for path in source_files() for found in long_functions(path)] == []


def test_a_long_function_is_named_with_its_place(tmp_path: Path, monkeypatch) -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    module = tmp_path / "long.py"
    module.write_text(f"def short():\n    return 1\n\n\n@staticmethod\ndef long():\n{body}\n")
    monkeypatch.setattr("test_code_size.ROOT", tmp_path)
    assert list(long_functions(module)) == [f"long.py:6 long ({MAX_FUNCTION_LINES + 2} lines)"]
