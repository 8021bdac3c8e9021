"""Reading configuration: YAML files that refuse duplicate keys, overlays merged, `key.path=value` overrides."""

from __future__ import annotations

import copy
from collections.abc import Hashable
from pathlib import Path
from typing import Any

import yaml

from rlhf_core.config.base import ConfigError
from rlhf_core.config.root import Config
from rlhf_core.config.validation import validate_config


def deep_merge(base: dict[str, Any], overlay: dict[str, Any]) -> dict[str, Any]:
    """Merge `overlay` into a copy of `base`: mappings merge key by key, anything else replaces."""
    merged = copy.deepcopy(base)
    for key, value in overlay.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def parse_override(text: str) -> dict[str, Any]:
    """Turn `a.b.c=value` into `{"a": {"b": {"c": value}}}`; the value is parsed as YAML."""
    key_path, sep, raw = text.partition("=")
    keys = key_path.strip().split(".")
    if not sep or not all(keys):
        raise ConfigError(f"override {text!r}: expected key.path=value, e.g. ppo.kl_coef=0.02")
    try:
        value = _load_yaml(raw, f"override {text!r}") if raw.strip() else None
    except yaml.YAMLError as err:
        raise ConfigError(f"override {text!r}: the value is not valid YAML ({err})") from err
    nested: dict[str, Any] = {keys[-1]: value}
    for key in reversed(keys[:-1]):
        nested = {key: nested}
    return nested


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping.

    Plain PyYAML keeps the last of two equal keys, so a section written twice in an overlay silently
    loses its first half. `<<` merge keys are not duplicates: keys given beside them override them.
    """

    source = "<string>"

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if not isinstance(key, Hashable):
                continue  # PyYAML itself reports an unhashable key
            if key in seen:
                raise ConfigError(
                    f"{self.source}: line {line}: duplicate key {key!r} (first given on line {seen[key]}); "
                    "YAML would keep only the last one: merge the two into one entry"
                )
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def _load_yaml(text: str, source: str) -> Any:
    """`yaml.safe_load` that refuses duplicate keys; `source` names the file in the error."""
    loader = _UniqueKeyLoader(text)
    loader.source = source
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def read_yaml_mapping(path: Path) -> dict[str, Any]:
    """Read a YAML file that must hold a mapping (an empty file is an empty mapping)."""
    if path.is_dir():
        yaml_files = sorted(str(child) for child in path.glob("*.yaml"))
        example = f" (here: {', '.join(yaml_files[:3])}{', ...' if len(yaml_files) > 3 else ''})" if yaml_files else ""
        raise ConfigError(f"{path} is a directory, not a config file: name one YAML file{example}")
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = _load_yaml(path.read_text(encoding="utf-8"), str(path)) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML ({err})") from err
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, got {type(data).__name__}")
    return data


def load_config(
    params_file: Path | str = "params.yaml",
    overlays: list[Path | str] | tuple[Path | str, ...] = (),
    overrides: list[str] | tuple[str, ...] = (),
) -> Config:
    """Resolve the configuration: params.yaml, then each overlay file, then each override."""
    raw = read_yaml_mapping(Path(params_file))
    for overlay in overlays:
        raw = deep_merge(raw, read_yaml_mapping(Path(overlay)))
    for override in overrides:
        raw = deep_merge(raw, parse_override(override))
    return validate_config(raw)
