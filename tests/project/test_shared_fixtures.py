"""The suite's shared pieces stay in one place: no test module works out the repository's root
itself (tests/fixtures/paths.py does), redefines a fixture that conftest.py or its plugins provide, or
holds a copy of a function or class that another test module or tests/fixtures/ already defines.

The modules are parsed, not imported. tests/scripts/ is left out: its scripts run in processes of their
own, whose import path does not hold tests/.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

from fixtures.paths import ROOT

TESTS = ROOT / "tests"
CONFTEST = TESTS / "conftest.py"
PATHS_MODULE = TESTS / "fixtures" / "paths.py"
ROOT_NAMES = {"ROOT", "REPO", "PROJECT"}


def suite_modules() -> list[Path]:
    return sorted(TESTS.rglob("test_*.py"))


def fixture_modules() -> list[Path]:
    return sorted((TESTS / "fixtures").glob("*.py"))


def parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def is_fixture(node: ast.AST) -> bool:
    """A function decorated with `pytest.fixture` or `pytest.fixture(...)`."""
    if not isinstance(node, ast.FunctionDef):
        return False
    for decorator in node.decorator_list:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        if isinstance(target, ast.Attribute) and target.attr == "fixture":
            return True
    return False


def fixture_names(tree: ast.Module) -> set[str]:
    return {node.name for node in tree.body if is_fixture(node)}


def plugin_paths() -> list[Path]:
    """The modules conftest.py registers in `pytest_plugins` ("fixtures.servers" -> tests/fixtures/servers.py)."""
    for node in parse(CONFTEST).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "pytest_plugins" for t in node.targets):
            names = ast.literal_eval(node.value)
            return [TESTS / (name.replace(".", "/") + ".py") for name in names]
    return []


def imported_fixture_paths(conftest: Path) -> list[Path]:
    """The modules of tests/fixtures/ a conftest.py imports fixtures from (tests/team/conftest.py)."""
    modules = [node.module for node in parse(conftest).body if isinstance(node, ast.ImportFrom) and node.module]
    return [TESTS / (name.replace(".", "/") + ".py") for name in modules if name.startswith("fixtures.")]


def shared_fixture_names() -> set[str]:
    names = fixture_names(parse(CONFTEST))
    imported = [path for conftest in TESTS.rglob("conftest.py") for path in imported_fixture_paths(conftest)]
    for path in [*plugin_paths(), *imported]:
        names |= fixture_names(parse(path))
    return names


def root_of_its_own(tree: ast.Module) -> list[str]:
    """Where a module uses `__file__` or assigns a repository-root name at its top level."""
    found = [f"line {node.lineno}: __file__" for node in ast.walk(tree) if getattr(node, "id", None) == "__file__"]
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        names = [getattr(target, "id", None) for target in targets]
        found += [f"line {node.lineno}: {name} =" for name in names if name in ROOT_NAMES]
    return found


def without_docstring(node: ast.FunctionDef | ast.ClassDef) -> str:
    """The definition's source as `ast.unparse` writes it, its docstring left out (copies often differ there)."""
    body = node.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    return ast.unparse(type(node)(**{**vars(node), "body": body or [ast.Pass()]}))


def test_no_test_module_works_out_the_repository_root() -> None:
    offenders = {
        path.relative_to(TESTS).as_posix(): found
        for path in [*suite_modules(), *fixture_modules(), CONFTEST]
        if path != PATHS_MODULE and (found := root_of_its_own(parse(path)))
    }
    assert not offenders, f"import ROOT (PARAMS, TINY, SCRIPTS) from fixtures.paths instead: {offenders}"


def test_no_test_module_redefines_a_shared_fixture() -> None:
    shared = shared_fixture_names()
    assert {"inputs", "data_dir", "tokenizer", "one_thread", "team_stack"} <= shared  # the parse finds them all
    offenders = {
        path.name: sorted(redefined) for path in suite_modules() if (redefined := fixture_names(parse(path)) & shared)
    }
    assert not offenders, f"these modules redefine fixtures of conftest.py or its plugins: {offenders}"


def test_no_function_or_class_is_copied_between_test_modules() -> None:
    places: dict[str, list[str]] = defaultdict(list)
    for path in [*suite_modules(), *fixture_modules()]:
        for node in parse(path).body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                places[without_docstring(node)].append(f"{path.relative_to(TESTS).as_posix()}:{node.name}")
    copies = [where for where in places.values() if len(where) > 1]
    assert not copies, f"defined more than once (move one copy to tests/fixtures/ and import it): {copies}"


def test_the_checks_see_a_copy() -> None:
    """The checks above on a module written to copy what they forbid: they are not vacuous."""
    source = (
        "from pathlib import Path\nimport pytest\n\nREPO = Path(__file__).resolve().parents[1]\n\n\n"
        "@pytest.fixture(scope='module')\ndef inputs(tmp_path_factory):\n    return tmp_path_factory.mktemp('x')\n"
    )
    tree = ast.parse(source)
    assert root_of_its_own(tree) == ["line 4: __file__", "line 4: REPO ="]
    assert fixture_names(tree) & shared_fixture_names() == {"inputs"}
    documented = source.replace("    return", '    """The same, with a docstring."""\n    return')
    first, second = ast.parse(source).body[-1], ast.parse(documented).body[-1]
    assert ast.get_docstring(second) and without_docstring(first) == without_docstring(second)
