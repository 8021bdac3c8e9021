"""constraints.txt, the tested dependency set the README installs with, pins every dependency it names.

An entry of pyproject.toml without a pin there would be resolved freshly at install time (and could make
pip backtrack again: README.md, "Quickstart"); a pin outside its range would make the install fail.
"""

from __future__ import annotations

from packaging.utils import canonicalize_name

from fixtures.dependencies import constraint_pins, project_requirements

UNPINNED = {"torch"}  # the install command names its build (CPU or CUDA)


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
