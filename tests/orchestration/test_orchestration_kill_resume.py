"""A pipeline process killed outright during PPO, then `rlhf run` again: PPO resumes from its checkpoint.

Prefect retries cover a stage that raises; a SIGKILL ends the flow run itself, and the rerun is a new
flow run with a new run directory. The rerun must still find the killed run's unfinished PPO output
(tasks/stages/resume.py), continue it from the newest checkpoint without repeating an iteration, and reuse
the finished SFT and reward-model outputs as cache hits. Both runs use Prefect's temporary server, as
`rlhf run` does without PREFECT_API_URL: the killed process held this machine's training slot, which
must not keep the rerun waiting (a file lock the kernel releases, tasks/execution/concurrency.py; before, the
slot stayed taken in PREFECT_HOME's database and the rerun waited forever).
"""

import json
import os
import subprocess
from pathlib import Path

import pytest

from fixtures.commands import RLHF_COMMAND, summary_lines
from fixtures.kill_resume import kill_at_first_checkpoint
from fixtures.pairs import write_topic_pairs
from fixtures.paths import PARAMS, ROOT, TINY
from fixtures.servers import seed_prefect_home
from rlhf_core.training.checkpoint import complete_checkpoints

pytestmark = pytest.mark.slow

PPO_STEPS = 6
CHECKPOINT_EVERY = 2
START_DEADLINE_S = 600
RUN_DEADLINE_S = 900


def run_command(data: Path) -> list[str]:
    """`rlhf run` up to PPO on the tiny config, with a PPO run long enough to be killed in the middle."""
    return [
        *RLHF_COMMAND,
        "run",
        "--params", str(PARAMS),
        "--config", str(TINY),
        "-s", f"ppo.steps={PPO_STEPS}",
        "-s", f"ppo.checkpoint_every={CHECKPOINT_EVERY}",
        "--data", str(data),
        "--stage", "ppo",
    ]  # fmt: skip


def test_killed_ppo_resumes_from_its_checkpoint_when_the_pipeline_is_rerun(
    tmp_path: Path, prefect_database: Path
) -> None:
    seed_prefect_home(tmp_path / "prefect-home", prefect_database)
    data = write_topic_pairs(tmp_path / "pairs.jsonl", 160)
    env = {key: value for key, value in os.environ.items() if not key.startswith(("PREFECT_", "MLFLOW_"))}
    env |= {
        "PREFECT_HOME": str(tmp_path / "prefect-home"),  # one temporary server's database for both runs
        "PYTHONPATH": str(ROOT),
        "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}",
    }
    ppo_dir = kill_at_first_checkpoint(run_command(data), tmp_path, env, tmp_path / "runs", "*/ppo", START_DEADLINE_S)
    checkpointed = [int(path.name.split("-")[1]) for path in complete_checkpoints(ppo_dir / "checkpoints")]
    assert not (ppo_dir / "metrics.json").exists()

    rerun = subprocess.run(
        run_command(data), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=RUN_DEADLINE_S
    )

    assert rerun.returncode == 0, rerun.stderr[-3000:]
    lines = summary_lines(rerun.stdout)
    rerun_dir = Path(lines["run directory"])
    assert rerun_dir != ppo_dir.parent  # a new flow run, with a directory of its own
    assert lines["stage ppo"].startswith(str(ppo_dir))  # ... that trained on in the killed run's PPO directory
    for stage in ("prepare-data", "sft", "reward"):
        assert lines[f"stage {stage}"].startswith(str(ppo_dir.parent))  # finished before the kill: cache hits
    metrics = json.loads((ppo_dir / "metrics.json").read_text())
    assert metrics["resumed_from"] >= max(checkpointed) >= CHECKPOINT_EVERY
    total = metrics["total_steps"]  # ppo.steps policy iterations after the critic-only ones
    assert total > PPO_STEPS and metrics["steps_completed"] == total
    steps = [json.loads(line)["step"] for line in (ppo_dir / "history.jsonl").read_text().splitlines()]
    assert steps == sorted(set(steps)) and steps[-1] == total  # no iteration logged twice
    assert not (tmp_path / "runs" / ".cache" / "in_progress").exists() or not any(
        (tmp_path / "runs" / ".cache" / "in_progress").iterdir()
    )  # the finished stage released its claim
