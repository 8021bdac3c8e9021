"""Training stages on a GPU work pool, handing files over by s3:// URI (tasks/execution/transfer.py,
tasks/stages/remote.py, flows/remote_stage.py). The transfer itself: tests/distributed/test_remote_transfer.py.

The integration scenario runs the pipeline the way infra/compose.yaml does, on loopback: two process
work pools, `rlhf-cpu` for the pipeline flow and `rlhf-gpu` for the `rlhf-stage` deployment, each served
by a `prefect worker start` subprocess in its own temporary directory (the flow runs' working
directories), a real Prefect server, an MLflow server and the S3 store. The tiny pipeline runs up to the
reward model with SFT remote: SFT runs on the GPU pool's worker, the reward model in the pipeline's own
flow run on the downloaded SFT model.

The ablation scenario then runs the `rlhf-ablation` deployment on the CPU pool with that pipeline run as
its base and `remote.stages: [ppo]`: each variant of configs/ablations/tiny.yaml trains as a flow run of
`rlhf-stage` on the GPU pool, and is evaluated and compared on the CPU pool; a second run of the same
ablation starts no stage run (the remote variants are cached like local ones).
"""

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from uuid import UUID

import pytest
from botocore.client import BaseClient
from mlflow import MlflowClient
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId, FlowRunFilter, FlowRunFilterId
from prefect.client.schemas.objects import FlowRun
from prefect.deployments import run_deployment
from prefect.deployments.runner import EntrypointType
from prefect.settings import PREFECT_API_URL, temporary_settings

from fixtures.pairs import write_topic_pairs
from fixtures.paths import PARAMS, TINY, TINY_GRID
from fixtures.servers import S3Server, _Server, log_tail, stop_server
from fixtures.work_pools import PIPELINE_DEPLOYMENT_NAME, deploy_to_pools, start_worker, wait_for_workers, worker_env
from flows.ablation import ABLATIONS_SUBDIR, COMPARISON_DIR, FLOW_TAG, rlhf_ablation
from flows.deployments import CPU_POOL, GPU_POOL
from flows.pipeline import rlhf_pipeline
from rlhf_core.ablation.report import COMPARISON_JSON
from rlhf_core.config import load_config
from rlhf_core.stage_outputs import COMPLETE_MARKER, StageOutput, output_sha256
from tasks.ablation.variant_tasks import VARIANT_TAG
from tasks.execution.transfer import MANIFEST, ensure_uploaded, join_uri, list_keys, read_stored, s3_client
from tasks.stages.remote import OUTPUT_URI_TAG, REMOTE_FLOW_RUN_TAG, RemoteStageError, RemoteStages, remote_stage_task
from tasks.stages.stage_runs import StageContext
from tasks.tracking.lineage import FLOW_RUN_ID_TAG
from tasks.tracking.mlflow_runs import PARENT_RUN_TAG, ROLE_TAG, STAGE_TAG, TrackingTarget

HANDOVER_BUCKET = "rlhf-handover"
ABLATION_DEPLOYMENT_NAME = "gpu-pool-test"
ABLATION_STORE = f"s3://{HANDOVER_BUCKET}/ablation-store"
VARIANTS = ("vanilla", "ppo_max")  # TINY_GRID's
WORKER_START_TIMEOUT_S = 120.0
FLOW_RUN_TIMEOUT_S = 600


# ------------------------------------------------------------------------------------------------
# the pipeline on rlhf-cpu, SFT on rlhf-gpu


@dataclass
class Scenario:
    pipeline_run: FlowRun
    stage_runs: list[FlowRun]
    stage_parent_flow_run_ids: list[UUID]  # the flow run of each stage run's parent task run
    task_states: dict[str, str]  # task name -> state name, in the pipeline's flow run
    cpu_dir: Path
    gpu_dir: Path
    s3: BaseClient
    tracking_uri: str
    prefect_api: str
    stage_deployment_id: UUID


@pytest.fixture(scope="module")
def scenario(
    tmp_path_factory: pytest.TempPathFactory, prefect_server: str, mlflow_server: str, s3_server: S3Server
) -> Iterator[Scenario]:
    s3_server.create_bucket(HANDOVER_BUCKET)
    data = write_topic_pairs(tmp_path_factory.mktemp("data") / "pairs.jsonl", 160)
    cpu_dir, gpu_dir = tmp_path_factory.mktemp("cpu-worker"), tmp_path_factory.mktemp("gpu-worker")
    env = worker_env(prefect_server, mlflow_server, s3_server)
    workers: list[_Server] = []
    try:
        with temporary_settings(updates={PREFECT_API_URL: prefect_server}):
            stage_deployment_id = deploy_to_pools(cpu_dir, gpu_dir)
            workers += [start_worker(CPU_POOL, cpu_dir, env), start_worker(GPU_POOL, gpu_dir, env)]
            wait_for_workers(dict(zip((CPU_POOL, GPU_POOL), workers)), WORKER_START_TIMEOUT_S)

            settings = {
                "config": [str(TINY)],
                "data": str(data),
                "params_file": str(PARAMS),
                "stages": ["reward"],  # with prepare-data and SFT before it
                "remote": {"stages": ["sft"], "store": f"s3://{HANDOVER_BUCKET}/runs"},
            }
            pipeline_run = run_deployment(
                f"{rlhf_pipeline.name}/{PIPELINE_DEPLOYMENT_NAME}",
                parameters={"settings": settings},
                timeout=FLOW_RUN_TIMEOUT_S,
            )
            with get_client(sync_client=True) as client:
                stage_runs = client.read_flow_runs(
                    deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[stage_deployment_id]))
                )
                task_runs = client.read_task_runs(
                    flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[pipeline_run.id]))
                )
                parents = [client.read_task_run(run.parent_task_run_id).flow_run_id for run in stage_runs]
        yield Scenario(
            pipeline_run=pipeline_run,
            stage_runs=stage_runs,
            stage_parent_flow_run_ids=parents,
            task_states={run.name.rsplit("-", 1)[0]: run.state.name for run in task_runs},
            cpu_dir=cpu_dir,
            gpu_dir=gpu_dir,
            s3=s3_server.client(),
            tracking_uri=mlflow_server,
            prefect_api=prefect_server,
            stage_deployment_id=stage_deployment_id,
        )
    finally:
        for worker in workers:
            stop_server(worker)  # the worker's process group: its flow-run subprocesses too


def parent_run(scenario: Scenario):
    client = MlflowClient(scenario.tracking_uri)
    experiment = client.get_experiment_by_name("rlhf-pipeline")
    (parent,) = client.search_runs(
        [experiment.experiment_id],
        filter_string=f"tags.`{FLOW_RUN_ID_TAG}` = '{scenario.pipeline_run.id}' and tags.`{ROLE_TAG}` = 'pipeline'",
    )
    return parent


def worker_logs(scenario: Scenario) -> str:
    return "\n".join(log_tail(directory / "worker.log") for directory in (scenario.cpu_dir, scenario.gpu_dir))


@pytest.mark.slow
def test_pipeline_on_the_cpu_pool_runs_sft_on_the_gpu_pool(scenario: Scenario) -> None:
    pipeline = scenario.pipeline_run
    assert pipeline.state.is_completed(), f"{pipeline.state.message}\n{worker_logs(scenario)}"
    assert pipeline.work_pool_name == CPU_POOL
    (stage,) = scenario.stage_runs
    assert stage.state.is_completed() and stage.work_pool_name == GPU_POOL
    assert stage.parameters["request"]["stage"] == "sft"
    assert scenario.stage_parent_flow_run_ids == [pipeline.id]  # a subflow of the pipeline's flow run
    states = scenario.task_states
    assert [states.get(name) for name in ("prepare-data", "sft-remote", "reward")] == ["Completed"] * 3
    assert "sft" not in states  # no local SFT task in the pipeline's flow run


@pytest.mark.slow
def test_sft_output_is_handed_over_by_uri_only(scenario: Scenario) -> None:
    tags = parent_run(scenario).data.tags
    run_dir = Path(tags["stage.sft.out_dir"]).parent
    uri = f"s3://{HANDOVER_BUCKET}/runs/{run_dir.name}/sft/"
    assert tags["stage.sft.uri"] == uri
    assert run_dir.parent == scenario.cpu_dir / "runs"  # the pipeline's run directory, on the CPU pool

    # In the store: the complete SFT output and the prepared data the pipeline uploaded for it.
    keys = set(list_keys(scenario.s3, HANDOVER_BUCKET, f"runs/{run_dir.name}/"))
    sft_keys = {key.removeprefix(f"runs/{run_dir.name}/sft/") for key in keys if "/sft/" in key}
    assert {COMPLETE_MARKER, MANIFEST, "model/model.safetensors", "history.jsonl"} <= sft_keys
    assert not any(key.startswith("checkpoints/") for key in sft_keys)
    assert f"runs/{run_dir.name}/data/{COMPLETE_MARKER}" in keys
    stored = read_stored(uri, scenario.s3)

    # SFT trained in the GPU worker's directory (with its checkpoints) on the data it downloaded ...
    (trained,) = [path.parent for path in (scenario.gpu_dir / "runs").glob(f"*/sft/{COMPLETE_MARKER}")]
    assert (trained / "checkpoints").is_dir()
    assert (trained.parent / "data" / COMPLETE_MARKER).is_file()
    assert output_sha256(trained, trained / "model") == stored.sha256
    # ... and reached the pipeline's run directory only by download: no checkpoints came along.
    local = run_dir / "sft"
    assert output_sha256(local, local / "model") == stored.sha256 == tags["stage.sft.sha256"]
    assert not (local / "checkpoints").exists()
    assert not list((scenario.gpu_dir / "runs").glob("*/reward"))  # the reward model trained on the CPU pool


@pytest.mark.slow
def test_stage_run_is_tracked_under_the_pipeline_and_reward_used_the_download(scenario: Scenario) -> None:
    parent = parent_run(scenario)
    client = MlflowClient(scenario.tracking_uri)
    sft_run = client.get_run(parent.data.tags["stage.sft.run_id"])
    assert sft_run.data.tags[STAGE_TAG] == "sft" and sft_run.data.tags[PARENT_RUN_TAG] == parent.info.run_id
    assert sft_run.data.tags[OUTPUT_URI_TAG] == parent.data.tags["stage.sft.uri"]
    assert sft_run.data.tags[REMOTE_FLOW_RUN_TAG] == str(scenario.stage_runs[0].id)
    assert sft_run.info.status == "FINISHED"

    # The reward model trained in the pipeline's own flow run, from the downloaded SFT directory.
    run_dir = Path(parent.data.tags["stage.sft.out_dir"]).parent
    assert Path(parent.data.tags["stage.reward.out_dir"]) == run_dir / "reward"
    assert (run_dir / "reward" / COMPLETE_MARKER).is_file()
    reward_run = client.get_run(parent.data.tags["stage.reward.run_id"])
    assert reward_run.data.tags[PARENT_RUN_TAG] == parent.info.run_id and OUTPUT_URI_TAG not in reward_run.data.tags


@pytest.mark.slow
def test_failed_remote_stage_fails_the_task_with_its_error(
    scenario: Scenario, prefect_api: str, s3_server: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prepared data whose stored copy is damaged after the upload: the stage flow run refuses it, and the
    pipeline's task fails with that error."""
    for name, value in {
        "AWS_ACCESS_KEY_ID": s3_server.access_key,
        "AWS_SECRET_ACCESS_KEY": s3_server.secret_key,
        "AWS_DEFAULT_REGION": s3_server.region,
        "AWS_ENDPOINT_URL": s3_server.endpoint_url,
    }.items():
        monkeypatch.setenv(name, value)
    data_dir = tmp_path / "run" / "data"
    data_dir.mkdir(parents=True)
    (data_dir / "sft.parquet").write_bytes(b"rows")
    (data_dir / COMPLETE_MARKER).write_text("{}")
    data = StageOutput(stage="prepare-data", out_dir=data_dir, sha256=output_sha256(data_dir, None))
    remote = RemoteStages(stages=["sft"], store=f"s3://{HANDOVER_BUCKET}/failing")
    client = s3_client()
    ensure_uploaded(data, join_uri(remote.store, "run", "data"), client)
    client.put_object(Bucket=HANDOVER_BUCKET, Key="failing/run/data/sft.parquet", Body=b"damaged")
    context = StageContext(
        run_dir=tmp_path / "run",
        cache_dir=tmp_path / ".cache",
        tracking=TrackingTarget(tracking_uri=scenario.tracking_uri, experiment_id="0", parent_run_id="unused"),
    )
    config = load_config(PARAMS, [TINY])

    with pytest.raises(RemoteStageError, match=r"ended Failed: .*CorruptOutputError"):
        remote_stage_task("sft", config, context, remote, data=data)  # a task run outside any flow
    assert not (tmp_path / "run" / "sft").exists()


# ------------------------------------------------------------------------------------------------
# an ablation on rlhf-cpu whose variants train on rlhf-gpu


@dataclass
class AblationRound:
    flow_run: FlowRun
    stage_runs: list[FlowRun]  # the rlhf-stage flow runs started from this ablation's flow run
    task_states: dict[str, str]  # task run name ("ppo[vanilla]", ...) -> state name
    parent: object  # the ablation's MLflow parent run


@dataclass
class AblationScenario:
    first: AblationRound
    again: AblationRound


def stage_runs_of(client, stage_deployment_id: UUID, parent_flow_run_id: UUID) -> list[FlowRun]:
    """The `rlhf-stage` flow runs whose parent task run belongs to the flow run `parent_flow_run_id`."""
    runs = client.read_flow_runs(deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[stage_deployment_id])))
    return [run for run in runs if client.read_task_run(run.parent_task_run_id).flow_run_id == parent_flow_run_id]


def ablation_parent_run(tracking_uri: str, flow_run_id: UUID):
    client = MlflowClient(tracking_uri)
    experiment = client.get_experiment_by_name("rlhf-pipeline")
    (parent,) = client.search_runs(
        [experiment.experiment_id],
        filter_string=f"tags.`{FLOW_RUN_ID_TAG}` = '{flow_run_id}' and tags.`{FLOW_TAG}` = 'rlhf-ablation'",
    )
    return parent


def run_ablation_deployment(scenario: Scenario, settings: dict) -> AblationRound:
    flow_run = run_deployment(
        f"{rlhf_ablation.name}/{ABLATION_DEPLOYMENT_NAME}",
        parameters={"settings": settings},
        timeout=FLOW_RUN_TIMEOUT_S,
    )
    assert flow_run.state.is_completed(), f"{flow_run.state.message}\n{worker_logs(scenario)}"
    with get_client(sync_client=True) as client:
        stage_runs = stage_runs_of(client, scenario.stage_deployment_id, flow_run.id)
        task_runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run.id])))
    return AblationRound(
        flow_run=flow_run,
        stage_runs=stage_runs,
        task_states={run.name: run.state.name for run in task_runs},
        parent=ablation_parent_run(scenario.tracking_uri, flow_run.id),
    )


@pytest.fixture(scope="module")
def ablation(scenario: Scenario) -> AblationScenario:
    base = Path(parent_run(scenario).data.tags["stage.sft.out_dir"]).parent  # the pipeline's run directory
    settings = {
        "grid": str(TINY_GRID),
        "config": [str(TINY)],
        "params_file": str(PARAMS),
        "base": str(base),
        "remote": {"stages": ["ppo"], "store": ABLATION_STORE},
    }
    with temporary_settings(updates={PREFECT_API_URL: scenario.prefect_api}):
        rlhf_ablation.to_deployment(
            name=ABLATION_DEPLOYMENT_NAME,
            work_pool_name=CPU_POOL,
            job_variables={"working_dir": str(scenario.cpu_dir)},
            entrypoint_type=EntrypointType.MODULE_PATH,
        ).apply()
        return AblationScenario(
            first=run_ablation_deployment(scenario, settings), again=run_ablation_deployment(scenario, settings)
        )


@pytest.mark.slow
def test_ablation_on_the_cpu_pool_trains_every_variant_on_the_gpu_pool_at_once(ablation: AblationScenario) -> None:
    first = ablation.first
    assert first.flow_run.work_pool_name == CPU_POOL
    ablation_dir = Path(first.parent.data.tags[f"variant.{VARIANTS[0]}.ppo.out_dir"]).parents[1]
    assert sorted(run.name for run in first.stage_runs) == sorted(
        f"ppo-{ablation_dir.name}-{name}" for name in VARIANTS
    )
    for run in first.stage_runs:
        assert run.state.is_completed() and run.work_pool_name == GPU_POOL
        assert run.parameters["request"]["stage"] == "ppo"
    # Started together: each variant's flow run was created before the other one ended.
    one, other = first.stage_runs
    assert one.created < other.end_time and other.created < one.end_time
    assert {first.task_states.get(f"{kind}[{name}]") for kind in ("ppo", "evaluate") for name in VARIANTS} == {
        "Completed"
    }


@pytest.mark.slow
def test_ablation_variants_come_back_by_uri_and_the_base_is_uploaded_once(
    scenario: Scenario, ablation: AblationScenario
) -> None:
    tags = ablation.first.parent.data.tags
    ablation_dir = Path(tags[f"variant.{VARIANTS[0]}.ppo.out_dir"]).parents[1]
    assert ablation_dir.parent == scenario.cpu_dir / "runs" / ABLATIONS_SUBDIR
    bucket_prefix = (
        ABLATION_STORE.removeprefix(f"s3://{HANDOVER_BUCKET}/") + f"/{ABLATIONS_SUBDIR}/{ablation_dir.name}/"
    )
    keys = set(list_keys(scenario.s3, HANDOVER_BUCKET, bucket_prefix))
    uploaded = {key.removeprefix(bucket_prefix) for key in keys if key.endswith(COMPLETE_MARKER)}
    assert uploaded == {f"base/{stage}/{COMPLETE_MARKER}" for stage in ("data", "sft", "reward")} | {
        f"{name}/ppo/{COMPLETE_MARKER}" for name in VARIANTS
    }
    for name in VARIANTS:
        local = Path(tags[f"variant.{name}.ppo.out_dir"])
        assert local == ablation_dir / name / "ppo" and not (local / "checkpoints").exists()
        stored = read_stored(f"{ABLATION_STORE}/{ABLATIONS_SUBDIR}/{ablation_dir.name}/{name}/ppo", scenario.s3)
        assert output_sha256(local, local / "model") == stored.sha256 == tags[f"variant.{name}.ppo.sha256"]
        # evaluated on the CPU pool against the base's SFT model, from the downloaded policy
        assert Path(tags[f"variant.{name}.eval.out_dir"]).is_relative_to(scenario.cpu_dir)
    trained = {path.parent for path in (scenario.gpu_dir / "runs").glob(f"*/ppo/{COMPLETE_MARKER}")}
    assert len(trained) == len(VARIANTS) and all((path / "checkpoints").is_dir() for path in trained)
    assert not list((scenario.gpu_dir / "runs").glob("*/evaluate"))


@pytest.mark.slow
def test_ablation_variant_runs_nest_under_the_ablation_and_the_comparison_holds_their_metrics(
    scenario: Scenario, ablation: AblationScenario
) -> None:
    client = MlflowClient(scenario.tracking_uri)
    parent = ablation.first.parent
    stage_run_ids = {run.name.rsplit("-", 1)[1]: str(run.id) for run in ablation.first.stage_runs}
    ablation_dir = Path(parent.data.tags[f"variant.{VARIANTS[0]}.ppo.out_dir"]).parents[1]
    comparison = json.loads((ablation_dir / COMPARISON_DIR / COMPARISON_JSON).read_text())
    rows = {row["variant"]: row for row in comparison["rows"]}
    for name in VARIANTS:
        run = client.get_run(parent.data.tags[f"variant.{name}.ppo.run_id"])
        assert run.data.tags[PARENT_RUN_TAG] == parent.info.run_id and run.data.tags[VARIANT_TAG] == name
        assert run.info.run_name == name and run.info.status == "FINISHED"
        assert run.data.tags[REMOTE_FLOW_RUN_TAG] == stage_run_ids[name]
        assert run.data.tags[OUTPUT_URI_TAG] == parent.data.tags[f"stage.ppo.{name}.uri"]
        ppo = json.loads((ablation_dir / name / "ppo" / COMPLETE_MARKER).read_text())
        judged = json.loads((Path(parent.data.tags[f"variant.{name}.eval.out_dir"]) / COMPLETE_MARKER).read_text())
        assert (
            rows[name]["final_kl"] == ppo["last/kl/token_k3"] and rows[name]["ppo_minutes"] == ppo["wall_time_s"] / 60
        )
        assert rows[name]["judge_win_minus_lose"]["mean"] == judged["win_minus_loss"]


@pytest.mark.slow
def test_ablation_rerun_starts_no_stage_run(ablation: AblationScenario) -> None:
    again = ablation.again
    assert again.stage_runs == []
    assert {again.task_states.get(f"ppo[{name}]") for name in VARIANTS} == {"Cached"}
    assert {again.parent.data.tags[f"variant.{name}.state"] for name in VARIANTS} == {"cached"}
