"""The ablation grid: named PPO variants of one base configuration.

A grid file (configs/ablations/*.yaml):

    name: paper                         # optional; default: the file's stem
    description: The paper's main comparisons.
    variants:
      - name: vanilla
        preset: vanilla
      - name: ppo_max-no_value_clip
        preset: ppo_max
        overrides: [ppo.value_clip=null]  # as `-s`; only ppo.* keys
        description: PPO-max without value clipping (5.3.2)

A variant's configuration is the base configuration (params.yaml + overlays + `-s` overrides, the
same for every variant) with its PPO recipe replaced:

1. `ppo.preset` becomes the variant's preset. When that is not the base's own preset, the Figure 5
   switches the base sets explicitly are dropped first: they refine the base's preset (configs/tiny.yaml
   shortens PPO-max's critic pretraining, say), and kept they would turn `vanilla` into something else.
   Switches kept from the base are recorded (`ResolvedVariant.inherited`) and shown in the comparison.
2. The variant's overrides are applied, `ppo.key=value` parsed as `-s` parses them. A key outside `ppo`
   is refused: the variants share the base's data, SFT model, reward model and seed, which is what
   makes the comparison controlled.

Every variant is resolved and validated before anything runs; an error names the variant and the key
(and all bad variants at once). Two variants that resolve to the same PPO settings are refused too:
they would be one cached run under two names.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from rlhf_core.config import (
    PPO_PRESETS,
    PRESET_SWITCHES,
    Config,
    ConfigError,
    PPOConfig,
    deep_merge,
    parse_override,
    read_yaml_mapping,
    validate_config,
)
from rlhf_core.form_order import number_fields

VARIANT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
VARIANT_SECTION = "ppo"
DEFAULT_PRESET: str = PPOConfig.model_fields["preset"].default


class VariantSpec(BaseModel):
    """One variant of a grid: a name, a preset and `ppo.*` overrides."""

    model_config = ConfigDict(extra="forbid", frozen=True, json_schema_extra=number_fields)

    name: str = Field(description="Names the variant's directory, MLflow run and table row (letters, digits, _ . -).")
    preset: str = Field(description=f"The PPO preset the variant starts from: {', '.join(PPO_PRESETS)}.")
    overrides: list[str] = Field(
        default_factory=list,
        description="ppo.key=value overrides applied over the preset (as -s), e.g. ppo.value_clip=null.",
    )
    description: str = Field("", description="What the variant tests, for the summary.")

    @field_validator("name")
    @classmethod
    def _name_is_a_path_segment(cls, name: str) -> str:
        if not VARIANT_NAME.match(name):
            raise ValueError(
                "expected letters, digits, '_', '.' or '-' (at most 64, not starting with '.', '_' or '-')"
            )
        return name

    @field_validator("preset")
    @classmethod
    def _known_preset(cls, preset: str) -> str:
        if preset not in PPO_PRESETS:
            raise ValueError(f"unknown preset; allowed: {', '.join(PPO_PRESETS)}")
        return preset


class GridSpec(BaseModel):
    """A list of variants to run on one base, with a name and a description for the comparison."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field("ablation", description="Names the comparison.")
    description: str = ""
    variants: list[VariantSpec] = Field(min_length=1)

    @field_validator("variants")
    @classmethod
    def _distinct_names(cls, variants: list[VariantSpec]) -> list[VariantSpec]:
        names = [variant.name for variant in variants]
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise ValueError(f"variant names must be distinct; repeated: {', '.join(repeated)}")
        return variants


@dataclass(frozen=True)
class ResolvedVariant:
    """A variant with its validated configuration, and the base switches it kept or dropped."""

    spec: VariantSpec
    config: Config
    inherited: dict[str, Any] = field(default_factory=dict)
    dropped: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.spec.name

    def settings_label(self) -> str:
        """`preset; key=value; ...`: the overrides as given, then the base switches kept."""
        parts = [self.spec.preset]
        parts += [override.strip().removeprefix(f"{VARIANT_SECTION}.") for override in self.spec.overrides]
        parts += [f"{key}={_yaml_scalar(value)} (base)" for key, value in self.inherited.items()]
        return "; ".join(parts)


@dataclass(frozen=True)
class AblationPlan:
    """Everything an ablation runs, resolved and validated: the grid, the base config, the variants."""

    grid: GridSpec
    base_config: Config
    variants: list[ResolvedVariant]


def read_grid(path: Path | str) -> GridSpec:
    """Read and validate a grid file; its name defaults to the file's stem."""
    path = Path(path)
    raw = read_yaml_mapping(path)
    try:
        return GridSpec.model_validate({"name": path.stem, **raw})
    except ValidationError as error:
        raise ConfigError(f"invalid ablation grid {path}: {_describe(error)}") from None


def _describe(error: ValidationError) -> str:
    """One `key.path: message (got value)` per problem, as validate_config words them."""
    lines = []
    for item in error.errors():
        location = ".".join(str(part) for part in item["loc"]) or "(top level)"
        message = item["msg"].removeprefix("Value error, ")
        lines.append(f"{location}: {message}" + ("" if item["type"] == "missing" else f" (got {item['input']!r})"))
    return "; ".join(lines)


def base_mapping(
    params_file: Path | str, overlays: Sequence[Path | str] = (), overrides: Sequence[str] = ()
) -> dict[str, Any]:
    """params.yaml + overlays + overrides merged as `load_config` merges them, NOT validated.

    The variants need the merged mapping rather than the `Config`: only the mapping says which
    switches the base sets explicitly (a validated config has every switch filled in).
    """
    raw = read_yaml_mapping(Path(params_file))
    for overlay in overlays:
        raw = deep_merge(raw, read_yaml_mapping(Path(overlay)))
    for override in overrides:
        raw = deep_merge(raw, parse_override(override))
    return raw


def variant_mapping(base: dict[str, Any], spec: VariantSpec) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(the variant's merged mapping, base switches kept, base switches dropped); see the module doc."""
    ppo = dict(base.get(VARIANT_SECTION) or {})
    explicit = {key: ppo[key] for key in PRESET_SWITCHES if key in ppo}
    same_preset = ppo.get("preset", DEFAULT_PRESET) == spec.preset
    if not same_preset:
        ppo = {key: value for key, value in ppo.items() if key not in explicit}
    raw = {**base, VARIANT_SECTION: {**ppo, "preset": spec.preset}}
    overridden: set[str] = set()
    for override in spec.overrides:
        parsed = parse_override(override)
        outside = [key for key in parsed if key != VARIANT_SECTION]
        if outside:
            raise ConfigError(
                f"override {override!r} sets {outside[0]}: a variant may set only {VARIANT_SECTION}.* keys "
                "(the variants share the base's data, models and seed)"
            )
        overridden |= set(parsed[VARIANT_SECTION]) if isinstance(parsed[VARIANT_SECTION], dict) else set()
        raw = deep_merge(raw, parsed)
    if not same_preset:
        return raw, {}, explicit
    return raw, {key: value for key, value in explicit.items() if key not in overridden}, {}


def resolve_variant(base: dict[str, Any], spec: VariantSpec) -> ResolvedVariant:
    """One variant's validated configuration; a ConfigError names the bad key."""
    raw, inherited, dropped = variant_mapping(base, spec)
    config = validate_config(raw)
    return ResolvedVariant(spec=spec, config=config, inherited=inherited, dropped=dropped)


def select_variants(grid: GridSpec, only: Sequence[str]) -> list[VariantSpec]:
    """The variants named in `only` (in grid order), or all of them; an unknown name is an error."""
    if not only:
        return list(grid.variants)
    known = {variant.name for variant in grid.variants}
    unknown = [name for name in only if name not in known]
    if unknown:
        raise ConfigError(
            f"ablation grid {grid.name}: no variant named {', '.join(map(repr, unknown))}; the grid has "
            f"{', '.join(sorted(known))}"
        )
    return [variant for variant in grid.variants if variant.name in only]


def resolve_variants(base: dict[str, Any], grid: GridSpec, only: Sequence[str] = ()) -> list[ResolvedVariant]:
    """Every selected variant resolved and validated, or one ConfigError naming each bad variant and key."""
    resolved: list[ResolvedVariant] = []
    errors: list[str] = []
    for spec in select_variants(grid, only):
        try:
            resolved.append(resolve_variant(base, spec))
        except ConfigError as error:
            errors.append(f"variant {spec.name!r}: {str(error).removeprefix('invalid configuration: ')}")
    if errors:
        raise ConfigError(f"invalid ablation grid {grid.name}: " + "; ".join(errors))
    check_distinct_settings(grid.name, resolved)
    return resolved


def check_distinct_settings(grid_name: str, variants: Sequence[ResolvedVariant]) -> None:
    """Refuse two variants whose PPO settings are equal: they would be one run (one cache key)."""
    seen: dict[str, str] = {}
    for variant in variants:
        settings = json.dumps(variant.config.ppo.model_dump(mode="json"), sort_keys=True)
        if settings in seen:
            raise ConfigError(
                f"invalid ablation grid {grid_name}: variants {seen[settings]!r} and {variant.name!r} resolve to "
                "the same PPO settings (they would be one run): change the overrides of one, or drop it"
            )
        seen[settings] = variant.name


def plan_ablation(
    grid: GridSpec,
    params_file: Path | str,
    overlays: Sequence[Path | str] = (),
    overrides: Sequence[str] = (),
    only: Sequence[str] = (),
) -> AblationPlan:
    """Resolve the base configuration and every variant; raises ConfigError before anything runs."""
    base = base_mapping(params_file, overlays, overrides)
    return AblationPlan(grid=grid, base_config=validate_config(base), variants=resolve_variants(base, grid, only))


def _yaml_scalar(value: Any) -> str:
    """A value as it would be written in an override (`null`, `false`, `0.2`)."""
    return json.dumps(value) if not isinstance(value, str) else value
