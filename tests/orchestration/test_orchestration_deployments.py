"""The deployments are defined once in code (flows/deployments.py) and declared again for work pools in
prefect.yaml: these tests check that the two agree, and that each declared entrypoint loads the flow the
code serves."""

import inspect
from pathlib import Path

import pytest
import yaml
from prefect.events import DeploymentEventTrigger
from prefect.flows import load_flow_from_entrypoint
from prefect.utilities.callables import parameter_schema

from fixtures.paths import ROOT
from flows.deployments import DEPLOYMENTS, DeploymentSpec, runner_deployment


@pytest.fixture(scope="module")
def declared() -> dict[str, dict]:
    document = yaml.safe_load((ROOT / "prefect.yaml").read_text())
    return {deployment["name"]: deployment for deployment in document["deployments"]}


def test_prefect_yaml_declares_exactly_the_served_deployments(declared: dict[str, dict]) -> None:
    served = {spec.name for spec in DEPLOYMENTS}
    assert (
        set(declared)
        == served
        == {"rlhf-pipeline", "rlhf-retrain", "rlhf-promote", "rlhf-human-eval", "rlhf-ablation", "rlhf-stage"}
    )


@pytest.mark.parametrize("spec", DEPLOYMENTS, ids=lambda spec: spec.name)
def test_declared_deployment_matches_the_code(spec: DeploymentSpec, declared: dict[str, dict]) -> None:
    entry = declared[spec.name]
    assert entry["entrypoint"] == spec.entrypoint
    assert entry["description"] == spec.description
    assert entry["parameters"] == spec.parameters
    assert tuple(entry["tags"]) == spec.tags
    assert entry.get("concurrency_limit") == spec.concurrency_limit
    schedules = [(item["cron"], item["timezone"]) for item in entry.get("schedules", [])]
    assert schedules == ([(spec.cron, spec.timezone)] if spec.cron else [])
    triggers = [DeploymentEventTrigger.model_validate(item) for item in entry.get("triggers", [])]
    assert [trigger.model_dump(exclude={"id"}) for trigger in triggers] == [
        trigger.model_dump(exclude={"id"}) for trigger in spec.triggers
    ]
    assert entry["work_pool"]["name"] == spec.work_pool
    assert spec.work_pool == ("rlhf-gpu" if spec.name == "rlhf-stage" else "rlhf-cpu")


@pytest.mark.parametrize("spec", DEPLOYMENTS, ids=lambda spec: spec.name)
def test_entrypoint_loads_the_served_flow(spec: DeploymentSpec, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # prefect deploy resolves entrypoints against the project directory
    loaded = load_flow_from_entrypoint(spec.entrypoint)
    assert loaded.name == spec.flow.name
    assert loaded.fn.__name__ == spec.flow.fn.__name__
    assert Path(inspect.getsourcefile(loaded.fn)).resolve() == Path(inspect.getsourcefile(spec.flow.fn)).resolve()


@pytest.mark.parametrize("spec", DEPLOYMENTS, ids=lambda spec: spec.name)
def test_served_deployment_carries_the_spec(spec: DeploymentSpec) -> None:
    deployment = runner_deployment(spec)
    assert deployment.name == spec.name
    assert deployment.parameters == spec.parameters
    assert deployment.entrypoint == f"{spec.flow.fn.__module__}.{spec.flow.fn.__name__}"
    crons = [(schedule.schedule.cron, schedule.schedule.timezone) for schedule in deployment.schedules or []]
    assert crons == ([(spec.cron, spec.timezone)] if spec.cron else [])
    assert [trigger.model_dump(exclude={"id"}) for trigger in deployment.triggers] == [
        trigger.model_dump(exclude={"id"}) for trigger in spec.triggers
    ]
    # The default parameters must be valid input for the flow's form. The stage flow has no defaults:
    # the pipeline sends each run its request (tests/distributed/test_gpu_pool.py).
    if spec.name != "rlhf-stage":
        spec.flow.validate_parameters(spec.parameters)


def test_retrain_runs_on_each_new_data_event_and_keeps_its_weekly_cron() -> None:
    from flows.deployments import RETRAIN_CRON
    from tasks.data.data_events import DATA_PUSHED_EVENT

    retrain = next(spec for spec in DEPLOYMENTS if spec.name == "rlhf-retrain")
    assert retrain.cron == RETRAIN_CRON
    (trigger,) = retrain.triggers
    assert trigger.expect == {DATA_PUSHED_EVENT} and trigger.enabled
    assert trigger.parameters == {
        "settings": {"data": "{{ event.payload.path }}", "data_version": "{{ event.payload.version }}"}
    }
    # What the server renders the templates into is valid input for the flow's form.
    rendered = {"settings": {"data": "data/raw", "data_version": "0123456789abcdef0123456789abcdef.dir"}}
    assert retrain.flow.validate_parameters(rendered)["settings"].data_version == rendered["settings"]["data_version"]


@pytest.mark.parametrize(
    "spec", [spec for spec in DEPLOYMENTS if spec.name != "rlhf-stage"], ids=lambda spec: spec.name
)
def test_each_form_lists_its_fields_in_the_models_order(spec: DeploymentSpec) -> None:
    """The UI orders a form's fields by `position`: without it a server on PostgreSQL (JSONB) lists them
    shortest name first. The stage flow is left out: the pipeline fills its form, not a person."""
    schema = parameter_schema(spec.flow.fn).model_dump()
    for name, model in schema["definitions"].items():
        if "properties" in model:
            assert [field["position"] for field in model["properties"].values()] == list(
                range(len(model["properties"]))
            ), name
