"""A rerun never mislabels or destroys finished work: SFT, reward-model and PPO outputs refuse checkpoints
made with other settings or inputs (naming what differs), and a rerun that fails on its inputs or on that
check leaves a finished output finished; `--restart` is the explicit way to start over."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from fixtures.commands import RLHF_COMMAND
from fixtures.paths import ROOT, TINY
from fixtures.tiny_ppo import StageInputs, save_sft_output, tiny_config  # noqa: F401
from rlhf_core.models.tiny import load_tiny_model
from rlhf_core.stages.ppo import run_ppo
from rlhf_core.stages.reward import run_train_rm
from rlhf_core.stages.sft import run_sft
from rlhf_core.stages.training_run import RUN_INPUTS_FILE, ResumeMismatchError

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def finished_sft(inputs: StageInputs, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("sft") / "sft"
    run_sft(tiny_config(), inputs.data_dir, out)
    return out


@pytest.fixture(scope="module")
def finished_rm(inputs: StageInputs, finished_sft: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("reward") / "reward"
    run_train_rm(tiny_config(), inputs.data_dir, finished_sft, out)
    return out


@pytest.fixture(scope="module")
def finished_ppo(inputs: StageInputs, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ppo") / "ppo"
    run_ppo(tiny_config(), inputs.data_dir, inputs.sft_dir, inputs.rm_dir, out)
    return out


def snapshot(out: Path) -> dict[str, str]:
    """The files that say a stage finished and with what settings."""
    return {name: (out / name).read_text() for name in ("metrics.json", "history.params.json")}


def rlhf(*args: str) -> subprocess.CompletedProcess[str]:
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [*RLHF_COMMAND, *args], cwd=ROOT, capture_output=True, text=True, timeout=300, env=environment, check=False
    )


# --- SFT and the reward model -------------------------------------------------------------------------


def test_a_mistyped_data_dir_leaves_a_finished_sft_output_finished(finished_sft: Path, tmp_path: Path) -> None:
    before = snapshot(finished_sft)
    with pytest.raises(FileNotFoundError, match="nowhere"):
        run_sft(tiny_config(), tmp_path / "nowhere", finished_sft)
    assert snapshot(finished_sft) == before


def test_the_reward_model_refuses_other_settings_naming_them_and_stays_finished(
    inputs: StageInputs, finished_sft: Path, finished_rm: Path, tmp_path: Path
) -> None:
    before = snapshot(finished_rm)
    with pytest.raises(ResumeMismatchError, match=r"reward\.lr: 0\.001 -> 0\.002.*--restart"):
        run_train_rm(tiny_config("reward.lr=0.002"), inputs.data_dir, finished_sft, finished_rm)
    with pytest.raises(FileNotFoundError, match="nowhere"):
        run_train_rm(tiny_config(), tmp_path / "nowhere", finished_sft, finished_rm)
    assert snapshot(finished_rm) == before


def test_the_reward_model_identifies_its_sft_model_by_content(
    inputs: StageInputs, finished_sft: Path, finished_rm: Path, tmp_path: Path
) -> None:
    """As PPO does: the same SFT model under a rewritten metrics.json is the same input (the run resumes),
    another SFT model beside byte-identical metrics.json is not (refused, naming it)."""
    same_model = tmp_path / "same-sft"
    shutil.copytree(finished_sft / "model", same_model / "model")
    metrics = json.loads((finished_sft / "metrics.json").read_text())
    (same_model / "metrics.json").write_text(json.dumps({**metrics, "wall_seconds": metrics["wall_seconds"] + 1}))
    resumed = run_train_rm(tiny_config(), inputs.data_dir, same_model, finished_rm)
    assert resumed.metrics["resumed_from"] == resumed.metrics["steps"] == 4

    other_model = save_sft_output(tmp_path / "other-sft", load_tiny_model()[1], seed=5)
    shutil.copyfile(finished_sft / "metrics.json", other_model / "metrics.json")
    with pytest.raises(ResumeMismatchError, match=r"SFT model changed \(sha256 [0-9a-f]{12} -> [0-9a-f]{12}\)"):
        run_train_rm(tiny_config(), inputs.data_dir, other_model, finished_rm)
    assert (finished_rm / "metrics.json").is_file()


def test_checkpoints_that_record_no_inputs_are_refused(inputs: StageInputs, tmp_path: Path) -> None:
    out = tmp_path / "sft"
    run_sft(tiny_config("sft.max_steps=2"), inputs.data_dir, out)
    (out / "checkpoints" / RUN_INPUTS_FILE).unlink()  # as an older version left them
    with pytest.raises(ResumeMismatchError, match=f"no {RUN_INPUTS_FILE}: an older version wrote them"):
        run_sft(tiny_config("sft.max_steps=2"), inputs.data_dir, out)
    assert (out / "metrics.json").is_file()


@pytest.mark.slow
def test_restart_discards_the_checkpoints_and_trains_with_the_new_settings(inputs: StageInputs, tmp_path: Path) -> None:
    out = tmp_path / "sft"
    command = ["sft", "-c", str(TINY), "--data-dir", str(inputs.data_dir), "--out", str(out)]
    assert rlhf(*command).returncode == 0
    refused = rlhf(*command, "-s", "sft.lr=0.002")
    assert refused.returncode == 1 and "sft.lr: 0.001 -> 0.002" in refused.stderr and "--restart" in refused.stderr
    restarted = rlhf(*command, "-s", "sft.lr=0.002", "--restart")
    assert restarted.returncode == 0, restarted.stderr
    assert "sft: trained 4 steps;" in restarted.stdout  # from scratch: no "resumed from"
    assert json.loads((out / "history.params.json").read_text())["loop"]["lr"] == 0.002
    assert json.loads((out / "checkpoints" / RUN_INPUTS_FILE).read_text())["settings"]["sft"]["lr"] == 0.002


# --- PPO ----------------------------------------------------------------------------------------------


def test_ppo_refuses_checkpoints_of_another_learning_rate_and_keeps_its_labels(
    inputs: StageInputs, finished_ppo: Path
) -> None:
    """The issue's case: `-s ppo.policy_lr=2e-4` on a finished 1e-4 run resumed its checkpoint and recorded 2e-4."""
    before = snapshot(finished_ppo)
    with pytest.raises(ResumeMismatchError, match=r"ppo\.policy_lr: 0\.0001 -> 0\.0002\..*another --out.*--restart"):
        run_ppo(tiny_config("ppo.policy_lr=2e-4"), inputs.data_dir, inputs.sft_dir, inputs.rm_dir, finished_ppo)
    assert snapshot(finished_ppo) == before
    assert json.loads(before["history.params.json"])["ppo"]["policy_lr"] == 1e-4


def test_ppo_refuses_another_sft_model_seed_or_data(inputs: StageInputs, finished_ppo: Path, tmp_path: Path) -> None:
    other_sft = save_sft_output(tmp_path / "other-sft", load_tiny_model()[1], seed=5)
    with pytest.raises(ResumeMismatchError, match=r"SFT model changed \(sha256 [0-9a-f]{12} -> [0-9a-f]{12}\)"):
        run_ppo(tiny_config(), inputs.data_dir, other_sft, inputs.rm_dir, finished_ppo)
    with pytest.raises(ResumeMismatchError, match=r"seed: 42 -> 7"):
        run_ppo(tiny_config("seed=7"), inputs.data_dir, inputs.sft_dir, inputs.rm_dir, finished_ppo)
    other_data = shutil.copytree(inputs.data_dir, tmp_path / "other-data")
    report = other_data / "data_report.json"
    report.write_text(report.read_text().replace('"rows_read"', '"rows_read" ', 1))
    with pytest.raises(ResumeMismatchError, match=r"data changed"):
        run_ppo(tiny_config(), other_data, inputs.sft_dir, inputs.rm_dir, finished_ppo)
    assert (finished_ppo / "metrics.json").is_file()
