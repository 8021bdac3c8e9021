"""constraints.txt, the tested dependency set the README installs with, pins every dependency it names.

An entry of pyproject.toml without a pin there would be resolved freshly at install time (and could make
pip backtrack again: README.md, "Quickstart"); a pin outside its range would make the install fail.
"""

from __future__ import annotations

import tomllib

from fixtures.paths import ROOT
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

UNPINNED = {"torch"}  # the install command names its build (CPU or CUDA)


def constraint_pins() -> dict[str, str]:
    """{canonical name: version} of constraints.txt's `name==version` lines."""
    pins: dict[str, str] = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, separator, version = line.partition("==")
            assert separator, f"constraints.txt: {line!r} is not name==version"
            pins[canonicalize_name(name)] = version.strip()
    return pins


def project_requirements() -> list[Requirement]:
    """pyproject.toml's dependencies and its dev extra (what the README installs)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [Requirement(text) for text in [*project["dependencies"], *project["optional-dependencies"]["dev"]]]


def test_every_dependency_is_pinned_within_its_range() -> None:
    pins = constraint_pins()
    for requirement in project_requirements():
        name = canonicalize_name(requirement.name)
        if name in UNPINNED:
            assert name not in pins, f"constraints.txt pins {name}, which the install command chooses"
            continue
        assert name in pins, f"constraints.txt has no pin for {requirement.name} (regenerate it: its header)"
        assert requirement.specifier.contains(pins[name], prereleases=True), (
            f"constraints.txt pins {name}=={pins[name]}, outside pyproject.toml's {requirement}"
        )
