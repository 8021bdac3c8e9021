"""`rlhf ... --help` as a reader meets it: every help page is free of type tags
(`<bool>`, `<str>`), `rlhf run --stage` names every pipeline stage, and README.md's table of each
command's options says exactly what that command's `--help` lists, for every command there is.

In-process through Typer's runner: `--help` never reaches a command's body.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from fixtures.paths import ROOT
from flows.pipeline import Stage
from rlhf_cli.main import app

README = ROOT / "README.md"
# Typer's type tags: a type name, a list of one, a choice (`<a|b>`) or a range; not a placeholder (`runs/<id>`).
TYPE_TAG = re.compile(
    r"<(bool|str|int|float|path|file|directory|datetime|uuid|list\[[^\]]*\]|[^<>\s]*\|[^<>\s]*|[^<>]* range)>"
)
# A README row: | `rlhf data add FILE` | `--remote`, `--push`/`--no-push`, ... |
README_ROW = re.compile(r"^\| `rlhf ([a-z -]+?)(?: [A-Z]+)?` \| (.*) \|$")


def commands(group: Any, path: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
    """Every leaf command of the `rlhf` group (Typer's own click), by its words (`("data", "add")`)."""
    found: dict[tuple[str, ...], Any] = {}
    for name, command in group.commands.items():
        if hasattr(command, "commands"):  # a group: `rlhf data`, `rlhf config`
            found |= commands(command, (*path, name))
        else:
            found[(*path, name)] = command
    return found


ALL_COMMANDS = commands(typer.main.get_command(app))


def help_text(*words: str) -> str:
    result = CliRunner().invoke(app, [*words, "--help"], env={"COLUMNS": "100"})
    assert result.exit_code == 0, result.output
    return result.output


def help_options(words: tuple[str, ...]) -> list[set[str]]:
    """The options `--help` lists for a command, each as the set of its names (`{"-s", "--set"}`),
    `--help` itself left out. An option's line starts with two spaces and a dash; its names come before
    the first double space (`  -c, --config FILE  Overlay ...`, `  --push / --no-push  ...`)."""
    options_section = help_text(*words).split("\nOptions:\n", 1)[1]
    heads = [line.strip().split("  ")[0] for line in options_section.splitlines() if re.match(r"  -", line)]
    listed = [set(re.findall(r"--?[a-z][a-z-]*", head)) for head in heads]
    return [names for names in listed if "--help" not in names]


def readme_table() -> dict[tuple[str, ...], list[str]]:
    """README.md's table of each command's options: the command's words -> the option names it lists."""
    table = {}
    for line in README.read_text(encoding="utf-8").splitlines():
        if match := README_ROW.match(line):
            table[tuple(match[1].split())] = re.findall(r"`(--?[a-z][a-z-]*)`", match[2])
    return table


@pytest.mark.parametrize("words", sorted(ALL_COMMANDS), ids=" ".join)
def test_help_shows_no_type_tags(words: tuple[str, ...]) -> None:
    text = help_text(*words)
    assert TYPE_TAG.search(text) is None, text


def test_the_top_level_and_group_help_show_no_type_tags() -> None:
    for words in [(), ("data",), ("config",)]:
        text = help_text(*words)
        assert TYPE_TAG.search(text) is None, text


def test_run_stage_help_names_every_pipeline_stage() -> None:
    text = " ".join(help_text("run").split())
    listed = re.search(r"--stage STAGE .*?\(repeatable\): ([a-z, -]+)\.", text)
    assert listed is not None, text
    assert listed[1].split(", ") == [stage.value for stage in Stage]


def test_the_readme_lists_every_command() -> None:
    assert set(readme_table()) == set(ALL_COMMANDS)


@pytest.mark.parametrize("words", sorted(ALL_COMMANDS), ids=" ".join)
def test_the_readme_lists_exactly_the_options_of_help(words: tuple[str, ...]) -> None:
    documented = readme_table()[words]
    listed = help_options(words)
    for name in documented:
        assert any(name in names for names in listed), f"README: rlhf {' '.join(words)} {name}; --help: {listed}"
    for names in listed:
        assert names & set(documented), f"rlhf {' '.join(words)} --help lists {sorted(names)}; README does not"


def test_the_readme_no_longer_claims_every_subcommand_takes_out() -> None:
    assert "Every subcommand takes" not in README.read_text(encoding="utf-8")
