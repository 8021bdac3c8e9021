"""The rlhf-promote form's rules (flows/promote.py) in its JSON schema as well as in its validator.

The Prefect UI validates a Run form by sending the deployment's parameter schema and the values to the
server (`/ui/schemas/validate`), and the server validates the parameters again when it creates the flow
run; both use Prefect's Draft 2020-12 validator, called here directly and, in the last test, through a
real server. An override without a reason must be refused there, so no run starts, and by the model's
validator too (a direct call of the flow passes no schema).
"""

from dataclasses import replace
from typing import Any

import pytest
from prefect.client.orchestration import get_client
from prefect.exceptions import PrefectHTTPStatusError
from prefect.utilities.callables import parameter_schema
from prefect.utilities.schema_tools.validation import build_error_obj, validate
from pydantic import ValidationError

from flows.deployments import DEPLOYMENTS, runner_deployment
from flows.promote import PromoteSettings, rlhf_promote

NO_REASON = {"override": True}
CASES: list[tuple[dict[str, Any], bool]] = [
    ({}, True),
    ({"mode": "evaluate", "override": False, "reason": ""}, True),
    (NO_REASON, False),
    ({"override": True, "reason": ""}, False),
    ({"override": True, "reason": "  \t"}, False),
    ({"override": True, "reason": "people preferred it in the human evaluation"}, True),
    ({"mode": "rollback", "reason": "complaints after the release"}, True),
    ({"mode": "rollback", "override": True, "reason": "why not"}, False),
]


def form_schema() -> dict[str, Any]:
    """The parameter schema the rlhf-promote deployment sends to the server (what the form is built from)."""
    return parameter_schema(rlhf_promote.fn).model_dump()


def pydantic_accepts(values: dict[str, Any]) -> bool:
    try:
        PromoteSettings(**values)
    except ValidationError:
        return False
    return True


@pytest.mark.parametrize(("values", "valid"), CASES)
def test_the_schema_and_the_validator_agree_on_the_form(values: dict[str, Any], valid: bool) -> None:
    schema_errors = validate({"settings": values}, form_schema())
    assert (not schema_errors) is valid
    assert pydantic_accepts(values) is valid


def test_an_override_without_a_reason_is_reported_on_the_reason_field() -> None:
    errors = build_error_obj(validate({"settings": NO_REASON}, form_schema()))
    reason_errors = [{"property": "reason", "errors": ["'reason' is a required property"]}]
    assert errors == {"valid": False, "errors": [{"property": "settings", "errors": reason_errors}]}


@pytest.mark.slow
def test_the_prefect_server_refuses_the_form_and_the_run(prefect_api: str) -> None:
    promote = next(spec for spec in DEPLOYMENTS if spec.name == "rlhf-promote")
    deployment_id = runner_deployment(replace(promote, name="rlhf-promote-form-test")).apply()
    with get_client(sync_client=True) as client:
        try:
            deployment = client.read_deployment(deployment_id)
            assert deployment.enforce_parameter_schema
            answer = client.request(
                "POST",
                "/ui/schemas/validate",
                json={"schema": deployment.parameter_openapi_schema, "values": {"settings": NO_REASON}},
            ).json()
            assert answer["valid"] is False
            assert answer["errors"][0]["errors"][0]["property"] == "reason"

            with pytest.raises(PrefectHTTPStatusError) as refused:
                client.create_flow_run_from_deployment(deployment_id, parameters={"settings": NO_REASON})
            assert refused.value.response.status_code == 409
            assert "'reason' is a required property" in refused.value.response.text

            reasoned = {"settings": {"override": True, "reason": "people preferred it"}}
            created = client.create_flow_run_from_deployment(deployment_id, parameters=reasoned)
            client.delete_flow_run(created.id)  # nobody serves this test deployment: leave no run behind
        finally:
            client.delete_deployment(deployment_id)
