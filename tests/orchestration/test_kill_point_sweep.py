"""The kill-point sweep of a whole `rlhf run`, short: SIGKILL inside the evaluation, and inside
the registration once the first model's files reach the MLflow store, before any version exists; rerun
each to the end, and compare every model file, the evaluation and the registry with an uninterrupted run.
scripts/kill_point_sweep.py runs the full sweep (20 points or more, stage boundaries included) with the
same code (tests/fixtures/kill_sweep*.py).

The point choice and the comparison are tested on their own first, without processes.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fixtures.kill_sweep import LOGGED_MODEL_FILES, START, KillPoint, Project, Timeline, choose_points, write_data
from fixtures.kill_sweep_compare import differences, registry_problems, stage_dirs
from fixtures.kill_sweep_runs import reference_run, sweep_point

STAGES = ("prepare-data", "judge-reward", "sft", "reward", "ppo", "evaluate", "register")


def synthetic_timeline() -> Timeline:
    """A run of 140 s announcing the seven stages at 20, 30, 30, 50, 70, 100 and 120 s."""
    offsets = (20.0, 30.0, 30.0, 50.0, 70.0, 100.0, 120.0)
    lines = [(0.5, "Starting temporary server")]
    announced = enumerate(zip(offsets, STAGES), 1)
    lines += [(offset, f"Flow run 'x' - stage {number}/7: {stage}") for number, (offset, stage) in announced]
    return Timeline(lines=lines, returncode=0, wall_s=140.0)


def test_points_cover_every_stage_boundary_evaluation_and_registration_and_are_seeded() -> None:
    points = choose_points(synthetic_timeline(), 20, seed=3)
    assert len(points) == 20 and [point.index for point in points] == list(range(1, 21))
    assert points == choose_points(synthetic_timeline(), 20, seed=3)
    assert points != choose_points(synthetic_timeline(), 20, seed=4)
    boundaries = {point.anchor for point in points if point.kind == "boundary"}
    assert boundaries == set(STAGES) and all(p.delay_s == 0 for p in points if p.kind == "boundary")
    assert {point.anchor for point in points if point.kind == "evaluate"} == {"evaluate"}
    assert {point.anchor for point in points if point.kind == "register"} == {"register"}
    on_files = [point.until_exists for point in points if point.kind == "register"]
    assert on_files[0] == LOGGED_MODEL_FILES and not any(on_files[1:])  # the first: before any version
    assert all(0 <= point.offset_s <= 140 and point.delay_s >= 0 for point in points)
    assert [point.offset_s for point in points] == sorted(point.offset_s for point in points)


def test_a_point_before_the_first_stage_is_anchored_on_the_start() -> None:
    (point,) = [p for p in choose_points(synthetic_timeline(), 40, seed=0) if p.offset_s < 20][:1]
    assert point.anchor == START and point.delay_s == point.offset_s


def test_stage_directories_come_from_the_summary_lines() -> None:
    timeline = Timeline(lines=[(1.0, "stage sft: /p/runs/a/sft (0.1 min, cache hit: an earlier run's output)"),
                               (1.0, "12:00 | INFO | Flow run 'x' - stage 2/7: sft")])  # fmt: skip
    assert stage_dirs(timeline) == {"sft": Path("/p/runs/a/sft")}


def test_differences_name_the_item_and_the_registry_is_checked_on_its_own() -> None:
    identity = {"name": "rlhf-policy", "version": "1"}
    version = {"version": "1", "status": "READY", "tags": {"rlhf.content_sha256": "abc"}, "identity": identity}
    reference = {
        "exit": 0,
        "models": {"sft": {"model.safetensors": "1"}, "ppo": {"model.safetensors": "2"}},
        "evaluation": {"metrics.json": {"win_rate": 0.5}},
        "registry": {"rlhf-policy": {"versions": [version], "aliases": {"challenger": "abc"}}},
    }
    assert differences(reference, reference) == [] and registry_problems(reference["registry"]) == []
    twice = {"versions": [version, {**version, "version": "2"}], "aliases": {"challenger": "abc"}}
    candidate = {**reference, "models": {**reference["models"], "ppo": {}}, "registry": {"rlhf-policy": twice}}
    assert differences(reference, candidate) == ["models.ppo", "registry.rlhf-policy"]
    problems = ["rlhf-policy: 2 versions", f"rlhf-policy v2: says it is {identity}"]
    assert registry_problems(candidate["registry"]) == problems


@pytest.mark.slow  # whole `rlhf run` processes, each with its own Prefect server
def test_a_run_killed_in_evaluation_and_in_registration_before_any_version_reruns_to_the_same_end(
    tmp_path: Path, prefect_database: Path
) -> None:
    data = write_data(tmp_path)
    reference, timeline = reference_run(Project(tmp_path / "reference", data, prefect_database))
    spans = {stage: offset for offset, stage in timeline.stage_starts()}
    points = [
        KillPoint(1, "evaluate", "evaluate", (spans["register"] - spans["evaluate"]) / 2, 0.0),
        KillPoint(2, "register", "register", 0.0, spans["register"], until_exists=LOGGED_MODEL_FILES),
    ]
    results = [
        sweep_point(Project(tmp_path / f"point-{p.index}", data, prefect_database).create(), p, reference)
        for p in points
    ]
    assert [result.row() for result in results if not result.matches] == []
    assert all(result.killed.killed for result in results), [result.row() for result in results]
    in_registration = results[1]
    at_kill = in_registration.registry_at_kill  # killed before any version; a model's name may exist already
    assert all(entry["versions"] == [] for entry in at_kill.values()), at_kill
