"""The base of an ablation: the prepared data, SFT model, reward model and judge every variant shares.

`AblationSettings.base` (`rlhf ablate --base`) names a pipeline run one of three ways:
- its run directory (`runs/<created>-<id>`): the stage directories in it (data/, sft/, reward/,
  judge_reward/). A stage that was a cache hit in that run has no directory there; it is found through
  the run's MLflow parent run (named like the directory), whose `stage.<stage>.out_dir` tags name
  every stage's output (flows/pipeline.py `record_stage_runs`);
- the MLflow run id of the pipeline run, or of one of its stage runs;
- a registered policy, `models:/rlhf-policy@challenger` or `models:/rlhf-policy/3`: the pipeline run
  that registered it (its `rlhf.pipeline_run_id` tag).
`data`, `sft`, `reward` and `judge` name single inputs instead (stage output directories; the judge
also as the `models:/` URI of a registered reward model), with or without a base.

Each input becomes a `StageOutput` with the content hash the pipeline gave it, so each variant's cache
key is the key the pipeline's PPO stage has with the same settings: with a shared runs directory a
variant equal to the base run's PPO is a cache hit on that run's output.

The base's lineage goes on the ablation's MLflow parent run as `base.*` tags: the reference as given,
the pipeline run and its lineage tags (commit, config, data version, Prefect run), and each input's
directory and content hash.
"""

from __future__ import annotations

import re
from pathlib import Path

from mlflow import MlflowClient
from mlflow.entities import Run
from mlflow.exceptions import MlflowException
from pydantic import BaseModel, ConfigDict

from rlhf_core.layout import MODEL_DIR, stage_output_dir
from rlhf_core.stage_outputs import COMPLETE_MARKER, StageOutput, output_sha256
from tasks.registry.downloads import is_registry_uri, resolve_model_output, version_at_uri
from tasks.registry.registered_models import PIPELINE_RUN_TAG
from tasks.tracking.lineage import (
    CONFIG_TAG,
    DATA_SOURCE_TAG,
    DATA_VERSION_KIND_TAG,
    DATA_VERSION_TAG,
    FLOW_RUN_ID_TAG,
    GIT_COMMIT_TAG,
)
from tasks.tracking.mlflow_runs import PARENT_RUN_TAG, PIPELINE_ROLE, ROLE_TAG

REQUIRED_STAGES = ("prepare-data", "sft", "reward")
JUDGE_STAGE = "judge-reward"
OPTION_OF_STAGE = {"prepare-data": "data", "sft": "sft", "reward": "reward", JUDGE_STAGE: "judge"}
DATA_LINEAGE = (DATA_VERSION_TAG, DATA_SOURCE_TAG, DATA_VERSION_KIND_TAG)
COPIED_LINEAGE = (GIT_COMMIT_TAG, CONFIG_TAG, *DATA_LINEAGE, FLOW_RUN_ID_TAG)
BASE_TAG_PREFIX = "base."
MLFLOW_RUN_ID = re.compile(r"[0-9a-f]{32}")  # what MLflow names a run by (uuid4 hex)


class BaseReference(BaseModel):
    """What names the base: a pipeline run (`base`), and/or its inputs one by one."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    base: str | None = None
    data: str | None = None
    sft: str | None = None
    reward: str | None = None
    judge: str | None = None

    def check(self) -> None:
        """Refuse, without asking MLflow, a reference that cannot name a complete base: no base and a
        required input missing, a base that is neither a directory, a models:/ URI nor an MLflow run id,
        or a given input directory that is not a complete stage output. `rlhf ablate` runs this before
        Prefect starts, so such a mistake is one line rather than a failed flow run."""
        if self.base is None:
            missing = [OPTION_OF_STAGE[stage] for stage in REQUIRED_STAGES if not getattr(self, OPTION_OF_STAGE[stage])]
            if missing:
                raise ValueError(missing_inputs_message(None, missing))
        elif not (Path(self.base).is_dir() or is_registry_uri(self.base) or MLFLOW_RUN_ID.fullmatch(self.base)):
            raise ValueError(f"base {self.base!r}: not a directory, a models:/ URI or an MLflow run id")
        for stage, option in OPTION_OF_STAGE.items():
            directory = getattr(self, option)
            if directory is None:
                continue
            if stage != JUDGE_STAGE:
                check_stage_directory(stage, Path(directory).resolve())
            elif not is_registry_uri(directory) and not Path(directory).is_dir():
                raise FileNotFoundError(
                    f"judge {directory}: no such directory (a reward model directory or models:/ URI)"
                )


class AblationBase(BaseModel):
    """The resolved base: one StageOutput per input (no judge: the ablation trains or picks one)."""

    model_config = ConfigDict(frozen=True)

    reference: BaseReference
    data: StageOutput
    sft: StageOutput
    reward: StageOutput
    judge: StageOutput | None = None
    pipeline_run_id: str | None = None
    lineage: dict[str, str] = {}

    def inputs(self) -> dict[str, StageOutput]:
        """The inputs by stage name (the judge when there is one)."""
        found = {"prepare-data": self.data, "sft": self.sft, "reward": self.reward}
        return found | ({JUDGE_STAGE: self.judge} if self.judge is not None else {})

    def tags(self) -> dict[str, str]:
        """The `base.*` lineage tags of the ablation's parent run."""
        tags = {f"{BASE_TAG_PREFIX}{key}": value for key, value in self.lineage.items()}
        tags[f"{BASE_TAG_PREFIX}reference"] = self.reference.base or "(inputs given one by one)"
        if self.pipeline_run_id is not None:
            tags[f"{BASE_TAG_PREFIX}pipeline_run_id"] = self.pipeline_run_id
        for stage, output in self.inputs().items():
            tags[f"{BASE_TAG_PREFIX}{stage}.out_dir"] = str(output.out_dir)
            tags[f"{BASE_TAG_PREFIX}{stage}.sha256"] = output.sha256
        return tags

    def data_tags(self) -> dict[str, str]:
        """The raw data version of the base's pipeline run (`data.*` tags), for every stage run of the ablation."""
        return {key: value for key, value in self.lineage.items() if key in DATA_LINEAGE}

    def describe(self) -> list[str]:
        """Lines for the summary: where each input is, and its content hash."""
        run = f" (pipeline MLflow run {self.pipeline_run_id})" if self.pipeline_run_id else ""
        lines = [f"base: {self.reference.base or 'inputs given one by one'}{run}"]
        lines += [
            f"{stage}: `{output.out_dir}` (sha256 {output.sha256[:12]})" for stage, output in self.inputs().items()
        ]
        return lines


def find_pipeline_run(client: MlflowClient, experiment: str, base: str | None) -> Run | None:
    """The MLflow parent run of the pipeline run `base` names (see the module docstring), if it has one."""
    if base is None:
        return None
    if Path(base).is_dir():
        found = client.get_experiment_by_name(experiment)
        if found is None:
            return None
        runs = client.search_runs(
            [found.experiment_id],
            filter_string=(
                f"attributes.run_name = '{Path(base).resolve().name}' and tags.`{ROLE_TAG}` = '{PIPELINE_ROLE}'"
            ),
            max_results=1,
        )
        return runs[0] if runs else None
    if is_registry_uri(base):
        version = version_at_uri(client, base)
        if PIPELINE_RUN_TAG not in version.tags:
            raise ValueError(
                f"base {base}: the version has no {PIPELINE_RUN_TAG} tag: the pipeline did not register it"
            )
        return client.get_run(version.tags[PIPELINE_RUN_TAG])
    try:
        run = client.get_run(base)
    except MlflowException as error:
        raise ValueError(
            f"base {base!r}: not a directory, a models:/ URI or an MLflow run id ({error.message})"
        ) from None
    parent = run.data.tags.get(PARENT_RUN_TAG)
    return client.get_run(parent) if parent else run


def stage_directories(base: str | None, run: Run | None) -> dict[str, str]:
    """Each base stage's output directory: the run directory's own, else the one the MLflow run names."""
    found = {
        stage: run.data.tags[f"stage.{stage}.out_dir"]
        for stage in OPTION_OF_STAGE
        if run is not None and f"stage.{stage}.out_dir" in run.data.tags
    }
    if base is not None and Path(base).is_dir():
        for stage in OPTION_OF_STAGE:
            local = stage_output_dir(Path(base), stage)
            if (local / COMPLETE_MARKER).is_file():
                found[stage] = str(local)
    return found


def check_stage_directory(stage: str, out_dir: Path) -> None:
    """Refuse a directory that is not a complete output of `stage` (with its model/ for a training stage)."""
    if not out_dir.is_dir():
        raise FileNotFoundError(f"the base's {stage} output {out_dir}: no such directory")
    if not (out_dir / COMPLETE_MARKER).is_file():
        raise FileNotFoundError(
            f"the base's {stage} output {out_dir} is not a complete stage output (no {COMPLETE_MARKER})"
        )
    if stage != "prepare-data" and not (out_dir / MODEL_DIR).is_dir():
        raise FileNotFoundError(f"the base's {stage} output {out_dir} has no {MODEL_DIR}/ directory")


def missing_inputs_message(base: str | None, missing: list[str]) -> str:
    """Why a base lacks the inputs named `missing` (option names), and the two ways to give them."""
    where = f"base {base!r} names" if base else "no base given, and"
    return (
        f"{where} no {', '.join(missing)} output: pass a pipeline run (--base: its directory, MLflow run id or a "
        f"policy's models:/ URI) or each input ({', '.join(f'--{name} DIR' for name in missing)})"
    )


def stage_output(stage: str, directory: str, run: Run | None) -> StageOutput:
    """A finished stage's output directory as the StageOutput the pipeline made of it."""
    out_dir = Path(directory).resolve()
    check_stage_directory(stage, out_dir)
    model_dir = None if stage == "prepare-data" else out_dir / MODEL_DIR
    run_id = run.data.tags.get(f"stage.{stage}.run_id") if run is not None else None
    return StageOutput(
        stage=stage,
        out_dir=out_dir,
        sha256=output_sha256(out_dir, model_dir),
        model_dir=model_dir,
        mlflow_run_id=run_id,
    )


def resolve_base(
    reference: BaseReference, tracking_uri: str, experiment: str, reward_model_name: str, registry_cache: Path
) -> AblationBase:
    """The base `reference` names, every required input found and complete; see the module docstring."""
    reference.check()
    run = find_pipeline_run(MlflowClient(tracking_uri), experiment, reference.base)
    located = stage_directories(reference.base, run)
    located |= {stage: value for stage, option in OPTION_OF_STAGE.items() if (value := getattr(reference, option))}
    missing = [OPTION_OF_STAGE[stage] for stage in REQUIRED_STAGES if stage not in located]
    if missing:
        raise ValueError(missing_inputs_message(reference.base, missing))
    outputs = {stage: stage_output(stage, located[stage], run) for stage in REQUIRED_STAGES}
    judge = located.get(JUDGE_STAGE)
    return AblationBase(
        reference=reference,
        data=outputs["prepare-data"],
        sft=outputs["sft"],
        reward=outputs["reward"],
        judge=None if judge is None else resolve_model_output(judge, tracking_uri, reward_model_name, registry_cache),
        pipeline_run_id=run.info.run_id if run is not None else None,
        lineage={key: run.data.tags[key] for key in COPIED_LINEAGE if run is not None and key in run.data.tags},
    )
