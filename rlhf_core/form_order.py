"""The order a form shows a settings model's fields in: the order the model declares them.

Prefect's UI builds a Run form from a flow's parameter schema and shows each object's fields sorted by
their `position`, else in the order the schema lists them. A Prefect server on PostgreSQL stores that
schema as JSONB, which reorders an object's keys (shortest name first), so without positions a form on
the team stack lists `data` before `config` and a shared model's fields among the flow's own. Giving
each property its place keeps the declared order, inherited fields first, on any database.
"""

from __future__ import annotations

from typing import Any


def number_fields(schema: dict[str, Any]) -> None:
    """A model's `json_schema_extra`: each of its properties gets `position`, its place in the model."""
    for position, field in enumerate(schema.get("properties", {}).values()):
        field["position"] = position
