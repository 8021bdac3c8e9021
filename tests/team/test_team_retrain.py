"""Event-driven retraining on the team stack, as infra/README.md ("Data") sets it up: the project's DVC
remote in the S3 bucket `rlhf-data`, `rlhf data add` of a new preference file from a team member's shell,
and the `rlhf-retrain on new data` automation starting a retrain run that pulls that version from S3 on the
CPU worker, trains every stage and ends with the promotion decision.

The workers run in the stack's project folder (tests/fixtures/team/team_stack.py), so the project's
params.yaml is what a triggered run trains with (the event passes only the data and its version): here it
is the tiny configuration, written for this test and put back after it, with model names of its own so
that the registry's `rlhf-policy`, which the UI tests promote, is not touched.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
import yaml
from prefect.client.schemas.objects import FlowRun

from fixtures.pairs import write_topic_pairs
from fixtures.project_repos import git
from fixtures.team.prefect_ui import prefect_client
from fixtures.team.team_stack import TeamStack, admin_mlflow, wait_for_end
from rlhf_core.config.loader import deep_merge, parse_override, read_yaml_mapping
from tasks.data.dvc_data import data_version, run_dvc, workspace_matches
from tasks.registry.registered_models import CHALLENGER_ALIAS

pytestmark = pytest.mark.slow

POLICY = "team-retrain-policy"
TINY_RETRAIN = [
    f"tracking.policy_model_name={POLICY}",
    "tracking.reward_model_name=team-retrain-reward",
    "tracking.experiment=team-retrain",
    "sft.max_steps=2",
    "reward.max_steps=2",
    "ppo.steps=1",
    "evaluation.max_prompts=6",
]
TRIGGERED_RUN_DEADLINE_S = 120  # guards, not measurements
ADD_TIMEOUT_S = 300


@pytest.fixture
def tiny_project(team_stack: TeamStack) -> Iterator[Path]:
    """The stack's project folder as a git + DVC checkout whose default remote is the `rlhf-data` bucket, and
    whose params.yaml is the tiny configuration; params.yaml, the DVC settings and data/ are put back after."""
    project = team_stack.project_dir
    saved = {name: (project / name).read_text() for name in ("params.yaml", ".dvc/config")}
    tiny = deep_merge(read_yaml_mapping(project / "params.yaml"), read_yaml_mapping(project / "configs/tiny.yaml"))
    for override in TINY_RETRAIN:
        tiny = deep_merge(tiny, parse_override(override))
    (project / "params.yaml").write_text(yaml.safe_dump(tiny, sort_keys=False))
    git(project, "init", "-q")
    run_dvc(["remote", "add", "-d", "--force", "team", "s3://rlhf-data/dvc"], project)
    git(project, "add", "-A")
    git(project, "commit", "-q", "-m", "the team's project")
    try:
        yield project
    finally:
        for name, text in saved.items():
            (project / name).write_text(text)
        shutil.rmtree(project / ".git")
        shutil.rmtree(project / "data" / "raw", ignore_errors=True)
        (project / "data" / "raw.dvc").unlink(missing_ok=True)


def team_member_env(team_stack: TeamStack) -> dict[str, str]:
    """A team member's shell on the stack (infra/README.md, "Sign in" and "Data")."""
    access_key, secret_key = team_stack.s3_key
    return {
        **os.environ,
        **team_stack.client_env(),
        "AWS_ACCESS_KEY_ID": access_key,
        "AWS_SECRET_ACCESS_KEY": secret_key,
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": team_stack.s3_endpoint,
    }


def triggered_run(team_stack: TeamStack, version: str) -> FlowRun:
    """The rlhf-retrain flow run the automation started for data version `version`, waited for."""
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName

    retrain = DeploymentFilter(name=DeploymentFilterName(any_=["rlhf-retrain"]))
    deadline = time.monotonic() + TRIGGERED_RUN_DEADLINE_S
    with prefect_client(team_stack) as client:
        while time.monotonic() < deadline:
            for run in client.read_flow_runs(deployment_filter=retrain):
                if run.parameters.get("settings", {}).get("data_version") == version:
                    return run
            time.sleep(1)
    raise AssertionError(f"no rlhf-retrain run for data version {version} within {TRIGGERED_RUN_DEADLINE_S} s")


def test_rlhf_data_add_starts_a_retrain_that_pulls_from_s3_and_completes_on_the_worker(
    team_stack: TeamStack, tiny_project: Path, tmp_path: Path
) -> None:
    new = write_topic_pairs(tmp_path / "new-pairs.jsonl", 160)
    added = subprocess.run(
        [sys.executable, "-c", "from rlhf_cli.main import main; main()", "data", "add", str(new)],
        cwd=tiny_project,
        env=team_member_env(team_stack),
        capture_output=True,
        text=True,
        timeout=ADD_TIMEOUT_S,
        check=False,
    )
    assert added.returncode == 0, added.stderr[-3000:]
    version = data_version(tiny_project / "data" / "raw")
    assert "sent event rlhf.data.pushed" in added.stdout + added.stderr
    # Only the bucket has the data now: the worker must pull it from S3.
    shutil.rmtree(tiny_project / "data" / "raw")
    shutil.rmtree(tiny_project / ".dvc" / "cache")
    removed_at = datetime.now(UTC)

    flow_run = triggered_run(team_stack, version)
    with prefect_client(team_stack) as client:
        ended = wait_for_end(lambda: client.read_flow_run(flow_run.id))
    assert ended.state.name == "Completed", ended.state.message
    assert ended.start_time > removed_at  # it started with nothing local to train on
    assert data_version(tiny_project / "data" / "raw") == version and workspace_matches(tiny_project / "data" / "raw")
    with admin_mlflow(team_stack) as mlflow_client:
        challenger = mlflow_client.get_model_version_by_alias(POLICY, CHALLENGER_ALIAS)
    assert challenger.run_id
