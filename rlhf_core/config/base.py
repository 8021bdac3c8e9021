"""The base of every configuration section, and the error a bad configuration raises."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class ConfigError(ValueError):
    """A configuration that cannot be used; the message lists every bad key path."""


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, values are frozen after validation."""

    model_config = ConfigDict(extra="forbid", frozen=True)
