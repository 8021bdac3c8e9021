"""Input checks that need no service run before Prefect starts, as one line.

- `BaseReference.check` (tasks/ablation/base.py), without MLflow: no base and an input missing, a base
  that cannot name a run, an input directory that is not a complete stage output, a missing judge
  directory; a complete set of inputs passes.
- `rlhf ablate` without `--base` and `rlhf run` with a missing `--data` exit 1 with one `rlhf: error:`
  line, and their flows are never called.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fixtures.commands import run_main
from fixtures.paths import PARAMS, ROOT
from fixtures.tiny_ppo import write_stage_inputs
from tasks.ablation.base import BaseReference

GRID = ROOT / "configs" / "ablations" / "paper.yaml"


@pytest.fixture(scope="module")
def stage_inputs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Complete data, sft and reward stage outputs (tiny models) under one directory."""
    root = tmp_path_factory.mktemp("inputs")
    write_stage_inputs(root)
    return root


def test_no_base_needs_every_input() -> None:
    with pytest.raises(ValueError) as error:
        BaseReference(data="artifacts/data").check()
    assert str(error.value).startswith("no base given, and no sft, reward output: pass a pipeline run (--base")
    assert "--sft DIR, --reward DIR" in str(error.value)


def test_a_base_that_cannot_name_a_run_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"base 'runs/typo': not a directory, a models:/ URI or an MLflow run id"):
        BaseReference(base="runs/typo").check()
    BaseReference(base=str(tmp_path)).check()  # a directory: its stages may be found through MLflow
    BaseReference(base="models:/rlhf-policy@challenger").check()
    BaseReference(base="0123456789abcdef0123456789abcdef").check()  # an MLflow run id


def test_given_inputs_must_be_complete_stage_outputs(stage_inputs: Path, tmp_path: Path) -> None:
    complete = {
        "data": str(stage_inputs / "data"),
        "sft": str(stage_inputs / "sft"),
        "reward": str(stage_inputs / "reward"),
    }
    BaseReference(**complete).check()
    BaseReference(**complete, judge=str(stage_inputs / "reward")).check()
    BaseReference(**complete, judge="models:/rlhf-reward-judge/1").check()
    with pytest.raises(FileNotFoundError, match=r"the base's sft output .*nowhere: no such directory"):
        BaseReference(**complete | {"sft": str(tmp_path / "nowhere")}).check()
    (tmp_path / "half").mkdir()
    with pytest.raises(FileNotFoundError, match="half is not a complete stage output"):
        BaseReference(**complete | {"reward": str(tmp_path / "half")}).check()
    with pytest.raises(FileNotFoundError, match=r"judge .*nowhere: no such directory"):
        BaseReference(**complete, judge=str(tmp_path / "nowhere")).check()


def must_not_run(*args: object, **kwargs: object) -> None:
    raise AssertionError("the flow started although an input is missing")


@pytest.mark.slow  # imports the orchestration stack (Prefect, MLflow), which takes seconds
def test_rlhf_ablate_without_a_base_fails_in_one_line_before_the_flow(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import flows.ablation

    monkeypatch.setattr(flows.ablation, "rlhf_ablation", must_not_run)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    status, stderr = run_main(
        ["ablate", "--grid", str(GRID), "--data", "data", "--params", str(PARAMS)], monkeypatch, capsys
    )
    assert status == 1
    assert stderr.splitlines() == [
        "rlhf: error: no base given, and no sft, reward output: pass a pipeline run (--base: its directory, MLflow "
        "run id or a policy's models:/ URI) or each input (--sft DIR, --reward DIR)"
    ]


@pytest.mark.slow  # imports the orchestration stack (Prefect, MLflow), which takes seconds
def test_rlhf_run_with_missing_data_fails_in_one_line_before_the_flow(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import flows.pipeline

    monkeypatch.setattr(flows.pipeline, "rlhf_pipeline", must_not_run)
    monkeypatch.chdir(tmp_path)
    status, stderr = run_main(["run", "--data", "no-such-pairs.jsonl", "--params", str(PARAMS)], monkeypatch, capsys)
    assert status == 1
    assert stderr.splitlines() == [
        "rlhf: error: input not found: no-such-pairs.jsonl (a local path, so it was not looked up on the Hugging "
        "Face Hub; a Hub dataset id looks like namespace/name)"
    ]
