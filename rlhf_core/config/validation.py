"""Validating a merged mapping into a `Config`, with one message per bad key path."""

from __future__ import annotations

import types
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError

from rlhf_core.config.base import ConfigError
from rlhf_core.config.root import Config


def _describe_error(error: dict[str, Any], model: type[BaseModel]) -> str:
    """One line per pydantic error: key path, bad value, what is allowed."""
    location = ".".join(str(part) for part in error["loc"]) or "(top level)"
    if error["type"] == "extra_forbidden":
        allowed = ", ".join(sorted(_fields_at(model, error["loc"][:-1])))
        return f"{location}: unknown key; allowed keys here: {allowed}"
    message = error["msg"].removeprefix("Value error, ")
    if error["type"] == "missing":
        return f"{location}: required"
    return f"{location}: {message} (got {error['input']!r})"


def _section_type(annotation: Any) -> type[BaseModel] | None:
    """The section a field holds: `ModelConfig` for `ModelConfig` or `ModelConfig | None`; None for a scalar."""
    if get_origin(annotation) in (Union, types.UnionType):
        sections = [_section_type(argument) for argument in get_args(annotation)]
        return next((section for section in sections if section is not None), None)
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def _fields_at(model: type[BaseModel], location: tuple[Any, ...]) -> list[str]:
    """The field names of the (nested) section at `location`."""
    for part in location:
        field = model.model_fields.get(str(part))
        section = _section_type(field.annotation) if field else None
        if section is None:
            return []
        model = section
    return list(model.model_fields)


def _scalar_types(annotation: Any) -> set[Any]:
    """The scalar types a field annotation admits: `int | None` -> {int, NoneType}, Literal[0, 1] -> {int}."""
    origin = get_origin(annotation)
    if origin is Literal:
        return {type(value) for value in get_args(annotation)}
    if origin in (Union, types.UnionType):
        return set().union(*(_scalar_types(argument) for argument in get_args(annotation)))
    return {annotation} if isinstance(annotation, type) else set()


def _bool_number_mixups(raw: Any, model: type[BaseModel], location: tuple[str, ...] = ()) -> dict[tuple[str, ...], str]:
    """Key paths where a boolean stands for a number or a number for a boolean, each with its message.

    pydantic's lax mode reads `true` as 1 for an integer field and 1 as true for a boolean one, so
    `-s sft.max_steps=true` would quietly train one step. Booleans and numbers are kept apart here;
    other coercions (the string "1e-4" for a float) stay allowed.
    """
    if not isinstance(raw, dict):
        return {}
    found: dict[tuple[str, ...], str] = {}
    for key, value in raw.items():
        field = model.model_fields.get(str(key))
        if field is None:
            continue  # pydantic reports unknown keys
        path = (*location, str(key))
        section = _section_type(field.annotation)
        if section is not None:
            found |= _bool_number_mixups(value, section, path)
            continue
        admitted = _scalar_types(field.annotation)
        numbers = admitted & {int, float}
        if isinstance(value, bool) and numbers and bool not in admitted:
            kind = "an integer" if numbers == {int} else "a number"
            off = " (null turns it off)" if type(None) in admitted else ""
            found[path] = f"{'.'.join(path)}: expected {kind}{off}, got the boolean {str(value).lower()}"
        elif bool in admitted and not numbers and value is not None and not isinstance(value, bool):
            found[path] = f"{'.'.join(path)}: expected true or false, got {value!r}"
    return found


def validate_config(raw: dict[str, Any]) -> Config:
    """Validate a merged mapping; every problem is reported at once, by key path."""
    mixups = _bool_number_mixups(raw, Config)
    try:
        config = Config.model_validate(raw)
    except ValidationError as err:
        lines = [_describe_error(e, Config) for e in err.errors() if tuple(map(str, e["loc"])) not in mixups]
        raise ConfigError("invalid configuration: " + "; ".join([*mixups.values(), *lines])) from None
    if mixups:
        raise ConfigError("invalid configuration: " + "; ".join(mixups.values()))
    return config
