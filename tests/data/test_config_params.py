"""The code is the single source of the defaults: params.yaml and the README's switch table agree with it."""

from __future__ import annotations

import importlib
import re
from typing import Any

import pytest
from pydantic import BaseModel

from fixtures.paths import PARAMS, ROOT
from rlhf_core.config import PPO_PRESETS, PRESET_SWITCHES, Config, PPOConfig, read_yaml_mapping

README = ROOT / "README.md"

# Left out of params.yaml on purpose: the switches (a pinned switch would defeat `preset: vanilla`)
# and the random test model's shape (configs/tiny.yaml).
NOT_IN_PARAMS = {f"ppo.{name}" for name in PRESET_SWITCHES} | {"model.tiny"}


def leaf_paths(mapping: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """`{"a": {"b": 1}}` -> `{"a.b": 1}`."""
    paths: dict[str, Any] = {}
    for key, value in mapping.items():
        if isinstance(value, dict):
            paths |= leaf_paths(value, f"{prefix}{key}.")
        else:
            paths[f"{prefix}{key}"] = value
    return paths


def covered(path: str) -> bool:
    return any(path == skipped or path.startswith(skipped + ".") for skipped in NOT_IN_PARAMS)


def test_params_yaml_values_are_the_code_defaults() -> None:
    written = leaf_paths(read_yaml_mapping(PARAMS))
    defaults = leaf_paths(Config().model_dump(mode="json"))
    differing = {path: (value, defaults.get(path)) for path, value in written.items() if defaults.get(path) != value}
    assert not differing, f"params.yaml value != code default (params, code): {differing}"


def test_params_yaml_lists_every_field_but_the_switches() -> None:
    written = set(leaf_paths(read_yaml_mapping(PARAMS)))
    defaults = set(leaf_paths(Config().model_dump(mode="json")))
    missing = {path for path in defaults - written if not covered(path)}
    pinned = {path for path in written if covered(path)}
    assert not missing, f"fields missing from params.yaml: {sorted(missing)}"
    assert not pinned, f"params.yaml pins what it must leave to the preset: {sorted(pinned)}"


def all_sections() -> list[type[BaseModel]]:
    """Every section class reachable from `Config`."""
    found: list[type[BaseModel]] = []
    pending: list[type[BaseModel]] = [Config]
    while pending:
        model = pending.pop()
        found.append(model)
        for field in model.model_fields.values():
            annotation = field.annotation
            if isinstance(annotation, type) and issubclass(annotation, BaseModel) and annotation not in found:
                pending.append(annotation)
    return found


@pytest.mark.parametrize("section", all_sections(), ids=lambda model: model.__name__)
def test_every_field_says_what_it_means(section: type[BaseModel]) -> None:
    """A field is described on itself, unless it is a whole section (whose class docstring does)."""
    undescribed = [
        name
        for name, field in section.model_fields.items()
        if not field.description
        and not (isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel))
    ]
    assert not undescribed, f"{section.__name__}: fields without a description: {undescribed}"


def readme_switch_table() -> dict[str, tuple[str, str, str]]:
    """switch -> (ppo_max cell, vanilla cell, implemented-by cell) of the README's PPO-max table."""
    text = README.read_text(encoding="utf-8")
    table = text[text.index("### PPO-max switches") :].split("\n## ")[0]
    rows = {}
    for line in table.splitlines():
        match = re.match(r"\| `(\w+)`[^|]*\| ([^|]+) \| ([^|]+) \| [^|]+ \| ([^|]+) \|$", line)
        if match:
            rows[match[1]] = (match[2].strip(), match[3].strip(), match[4].strip())
    return rows


def cell_value(cell: str, default: Any) -> Any:
    """A table cell as a config value: on/off for switches, off is null for optional numbers."""
    if cell in ("on", "off"):
        return cell == "on" if isinstance(default, bool) else None
    try:
        return float(cell)
    except ValueError:
        return cell


def test_readme_switch_table_matches_the_presets() -> None:
    rows = readme_switch_table()
    assert set(rows) == set(PRESET_SWITCHES)
    for switch, (ppo_max, vanilla, _) in rows.items():
        default = PPO_PRESETS["ppo_max"][switch]
        assert cell_value(ppo_max, default) == default, switch
        assert cell_value(vanilla, default) == PPO_PRESETS["vanilla"][switch], switch


def test_readme_names_functions_that_exist() -> None:
    for switch, (*_, implemented_by) in readme_switch_table().items():
        for dotted in re.findall(r"`((?:ppo|stages)\.[\w.]+)`", implemented_by):
            module_path, _, attribute = dotted.rpartition(".")
            if module_path.count(".") > 1:  # ppo.learner.LocalLearner.clip_gradients: a method
                module_path, _, owner = module_path.rpartition(".")
                target = getattr(importlib.import_module(f"rlhf_core.{module_path}"), owner)
            else:
                target = importlib.import_module(f"rlhf_core.{module_path}")
            assert hasattr(target, attribute), f"{switch}: {dotted} does not exist"


def test_ppo_max_is_the_paper_recipe() -> None:
    """Pinned values, so a change of a default is a visible decision (docs/stages-ppo.md 'Departures')."""
    config = PPOConfig()
    assert (config.kl_coef, config.reward_clip, config.value_clip, config.clip_eps) == (0.01, 5.0, 0.2, 0.2)
    assert config.reward_normalization and not config.advantage_normalization
    assert (config.gamma, config.lam, config.max_grad_norm, config.critic_init) == (1.0, 0.95, 1.0, "reward")
