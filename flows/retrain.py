"""The `rlhf-retrain` flow: pull the data version the checkout pins, run the whole pipeline, then promote.

Scheduled by the `rlhf-retrain` deployment (flows/deployments.py). The raw preference data is the
DVC-tracked directory `data/raw`; its `.dvc` file, committed with the code, names the newest data
version (`rlhf data add` writes it), and `dvc pull` brings that version into the workspace from the
DVC remote. The pipeline then versions it by the same md5, and its `register` stage puts the new
policy in the registry under the alias `challenger`; unchanged data and settings make every stage a
cache hit and leave the registry as it was. It ends with the `rlhf-promote` flow (flows/promote.py):
the challenger becomes the `champion` if it passes the promotion gate, and the result says why not
otherwise.

The deployment runs it on a weekly cron and on every `rlhf.data.pushed` event (`rlhf data add`,
tasks/data/data_events.py), whose trigger passes the pushed version as `data_version`: the pulled data must
then be that version, else the run stops before training, saying that this checkout's .dvc file pins
another version (the new .dvc file is not committed and pulled here yet). The DVC remote is checked
before the pull (tasks/preflight.py).
"""

from __future__ import annotations

from pathlib import Path

from prefect import flow, task
from prefect.cache_policies import NO_CACHE
from pydantic import BaseModel, Field

from flows.pipeline import PipelineResult, PipelineSettings, rlhf_pipeline
from flows.promote import PromoteSettings, rlhf_promote
from flows.run_settings import RunSettings
from tasks.data import dvc_data
from tasks.preflight import dvc_remote_services
from tasks.promotion.promote_tasks import PromotionResult
from tasks.services.probes import check_services

PULL_RETRIES = 2
PULL_RETRY_DELAY_SECONDS = 30


class RetrainSettings(RunSettings):
    """What a scheduled retraining runs on (the form of the Run dialog in the Prefect UI)."""

    data: str = Field("data/raw", description="The DVC-tracked raw data to pull and train on.")
    data_version: str | None = Field(
        None,
        description="The data version (DVC md5) to train on, as the new-data event names it; "
        "empty: the version the checkout's .dvc file pins.",
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


class DataVersionMismatchError(RuntimeError):
    """The checkout pins another data version than the one the run was asked to train on."""


def check_data_version(data: Path, expected: str | None) -> None:
    """Fail when `expected` is given and the .dvc file of `data` pins another version."""
    if not expected:
        return
    pinned = dvc_data.data_version(data)
    if pinned != expected:
        tracked = dvc_data.dvc_file(data)
        raise DataVersionMismatchError(
            f"asked to train on data version {expected}, but {tracked} in {Path.cwd()} pins {pinned}: commit "
            f"the new {tracked.name} where `rlhf data add` ran and update this checkout (git pull), then rerun"
        )


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
    target = Path(settings.data).resolve()
    check_services(dvc_remote_services(target.parent))
    check_data_version(target, settings.data_version)  # before the pull: a stale checkout fails at once
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
