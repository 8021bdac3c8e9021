"""The `rlhf-retrain` flow: pull the data version the checkout pins, run the whole pipeline, then promote.

Scheduled by the `rlhf-retrain` deployment (flows/deployments.py). The raw preference data is the
DVC-tracked directory `data/raw`; its `.dvc` file, committed with the code, names the newest data
version (`rlhf data add` writes it), and `dvc pull` brings that version into the workspace from the
DVC remote. The pipeline then versions it by the same md5, and its `register` stage puts the new
policy in the registry under the alias `challenger`; unchanged data and settings make every stage a
cache hit and leave the registry as it was. It ends with the `rlhf-promote` flow (flows/promote.py):
the challenger becomes the `champion` if it passes the promotion gate, and the result says why not
otherwise.
"""

from __future__ import annotations

from pathlib import Path

from prefect import flow, task
from prefect.cache_policies import NO_CACHE
from pydantic import BaseModel, ConfigDict, Field

from flows.pipeline import PipelineResult, PipelineSettings, rlhf_pipeline
from flows.promote import PromoteSettings, rlhf_promote
from tasks import dvc_data
from tasks.promotion import PromotionResult
from tasks.remote import RemoteStages

PULL_RETRIES = 2
PULL_RETRY_DELAY_SECONDS = 30


class RetrainSettings(BaseModel):
    """What a scheduled retraining runs on (the form of the Run dialog in the Prefect UI)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    data: str = Field("data/raw", description="The DVC-tracked raw data to pull and train on.")
    config: list[str] = Field(default_factory=list, description="Overlay YAML files (e.g. configs/tiny.yaml).")
    overrides: list[str] = Field(default_factory=list, description="key.path=value overrides.")
    params_file: str = Field("params.yaml", description="The base parameter file.")
    runs_dir: str = Field("runs", description="Where run directories and the stage cache are written.")
    remote: RemoteStages = Field(
        default_factory=RemoteStages,
        description="Training stages to run on another work pool (the rlhf-stage deployment), files via S3.",
    )


DEFAULT_SETTINGS = RetrainSettings()


class RetrainResult(BaseModel):
    """The pipeline run and the promotion decision that ended it."""

    pipeline: PipelineResult
    promotion: PromotionResult

    def summary(self) -> str:
        """The pipeline's summary, then the decision."""
        return f"{self.pipeline.summary()}\npromotion: {self.promotion.decision}: {self.promotion.message}"


@task(name="pull-data", cache_policy=NO_CACHE, retries=PULL_RETRIES, retry_delay_seconds=PULL_RETRY_DELAY_SECONDS)
def pull_data_task(target: str) -> str:
    """`dvc pull` the data version `target`'s .dvc file pins; returns the data's absolute path."""
    path = Path(target).resolve()
    dvc_data.dvc_pull(path)
    return str(path)


def pipeline_settings(settings: RetrainSettings, data: str) -> PipelineSettings:
    """The pipeline run a retraining asks for: every stage, on the pulled `data`."""
    return PipelineSettings(
        config=settings.config,
        overrides=settings.overrides,
        data=data,
        params_file=settings.params_file,
        runs_dir=settings.runs_dir,
        remote=settings.remote,
    )


@flow(
    name="rlhf-retrain",
    description="Pull the newest DVC data version, rerun the pipeline, register a challenger, promote it if it passes.",
)
def rlhf_retrain(settings: RetrainSettings = DEFAULT_SETTINGS) -> RetrainResult:
    """Pull the data, run every stage of `rlhf-pipeline` on it, then `rlhf-promote` (both as subflows)."""
    data = pull_data_task(settings.data)
    pipeline = rlhf_pipeline(pipeline_settings(settings, data))
    promotion = rlhf_promote(
        PromoteSettings(
            config=settings.config,
            overrides=settings.overrides,
            params_file=settings.params_file,
            runs_dir=settings.runs_dir,
        )
    )
    return RetrainResult(pipeline=pipeline, promotion=promotion)
