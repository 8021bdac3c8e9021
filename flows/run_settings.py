"""The fields every training flow's form shares: which configuration, where runs go, what runs remotely.

`rlhf-pipeline`, `rlhf-retrain` and `rlhf-ablation` each build a configuration from the params file,
overlays and overrides, write under a runs directory, and may send training stages to another work pool.
Their settings models extend this one, so each field's default and meaning are written once.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from rlhf_core.form_order import number_fields
from rlhf_core.layout import RUNS_DIR
from tasks.stages.remote import RemoteStages


class RunSettings(BaseModel):
    """The shared part of a training flow's Run form: its fields come first (`number_fields`)."""

    model_config = ConfigDict(extra="forbid", frozen=True, json_schema_extra=number_fields)

    config: list[str] = Field(
        default_factory=list,
        description="Overlay YAML files merged over the params file, in order (e.g. configs/tiny.yaml).",
    )
    overrides: list[str] = Field(
        default_factory=list, description="key.path=value overrides, applied last (e.g. ppo.kl_coef=0.02)."
    )
    params_file: str = Field("params.yaml", description="The base parameter file.")
    runs_dir: str = Field(str(RUNS_DIR), description="Where run directories and the stage cache are written.")
    remote: RemoteStages = Field(
        default_factory=RemoteStages,
        description="Training stages to run on another work pool (the rlhf-stage deployment), files via S3.",
    )
