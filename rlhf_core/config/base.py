"""The base of every configuration section, and the error a bad configuration raises."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class ConfigError(ValueError):
    """A configuration that cannot be used; the message lists every bad key path."""


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, values are frozen after validation, and a
    number must be finite (`-s sft.lr=.nan` is refused as not a finite number rather than compared with
    the field's bounds, which every NaN fails with a misleading "less than" message)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


def check_ratio_band(low: float | None, high: float | None, low_key: str, high_key: str) -> None:
    """Refuse a band of ratios whose lower end is not below its upper end (None leaves that side open)."""
    if low is not None and high is not None and low >= high:
        raise ValueError(f"{low_key} {low:g} must be < {high_key} {high:g}: the band [{low_key}, {high_key}] is empty")
