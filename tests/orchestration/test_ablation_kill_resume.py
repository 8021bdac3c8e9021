"""`rlhf ablate` killed outright while a variant trains, then run again: that variant resumes from its checkpoint.

A SIGKILL ends the flow run itself; the rerun is a new flow run with a new ablation directory. It must
find the killed variant's unfinished PPO output through the variant's claim (tasks/stages/resume.py, keyed like
its cache), continue it from the newest checkpoint without repeating an iteration (the PPO stage checks
checkpoints/run_inputs.json first), and then evaluate and compare it. Both runs use Prefect's
temporary server, as `rlhf ablate` does without PREFECT_API_URL: the killed process held this machine's
training slot, which must not keep the rerun waiting (tasks/execution/concurrency.py). The rerun that works
prints no traceback and no ERROR line.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from fixtures.commands import RLHF_COMMAND
from fixtures.kill_resume import kill_at_first_checkpoint
from fixtures.paths import PARAMS, ROOT, TINY
from fixtures.servers import seed_prefect_home
from fixtures.tiny_ppo import save_rm_output, write_stage_inputs
from rlhf_core.training.checkpoint import complete_checkpoints

pytestmark = pytest.mark.slow

PPO_STEPS = 12
CHECKPOINT_EVERY = 2
START_DEADLINE_S = 600
RUN_DEADLINE_S = 900


def ablate_command(base: Path, runs_dir: Path) -> list[str]:
    """`rlhf ablate` of the tiny grid's vanilla variant, with a PPO run long enough to be killed in the middle."""
    return [
        *RLHF_COMMAND,
        "ablate",
        "--grid", str(ROOT / "configs" / "ablations" / "tiny.yaml"),
        "--variant", "vanilla",
        "--base", str(base),
        "--params", str(PARAMS),
        "--config", str(TINY),
        "-s", f"ppo.steps={PPO_STEPS}",
        "-s", f"ppo.checkpoint_every={CHECKPOINT_EVERY}",
        "--runs-dir", str(runs_dir),
    ]  # fmt: skip


def test_a_variant_killed_mid_run_resumes_from_its_checkpoint_on_rerun(
    tmp_path: Path, tokenizer, prefect_database: Path
) -> None:
    seed_prefect_home(tmp_path / "prefect-home", prefect_database)
    (tmp_path / "base").mkdir()
    write_stage_inputs(tmp_path / "base")
    save_rm_output(tmp_path / "base" / "judge_reward", tokenizer, seed=2)
    env = {key: value for key, value in os.environ.items() if not key.startswith(("PREFECT_", "MLFLOW_"))}
    env |= {
        "PREFECT_HOME": str(tmp_path / "prefect-home"),  # one temporary server's database for both runs
        "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "OMP_NUM_THREADS": "1",
    }
    command = ablate_command(tmp_path / "base", tmp_path / "runs")
    ppo_dir = kill_at_first_checkpoint(
        command, tmp_path, env, tmp_path / "runs", "ablations/*/vanilla/ppo", START_DEADLINE_S
    )
    checkpointed = [int(path.name.split("-")[1]) for path in complete_checkpoints(ppo_dir / "checkpoints")]
    assert not (ppo_dir / "metrics.json").exists()

    rerun = subprocess.run(
        command, check=False, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=RUN_DEADLINE_S
    )

    assert rerun.returncode == 0, rerun.stderr[-3000:]
    terminal = rerun.stdout + rerun.stderr
    assert "Traceback" not in terminal
    assert [line for line in terminal.splitlines() if re.search(r"\bERROR\b", line)] == []
    lines = dict(line.split(": ", 1) for line in rerun.stdout.splitlines() if ": " in line)
    ablation_dir = Path(lines["ablation directory"])
    assert ablation_dir != ppo_dir.parent.parent  # a new flow run, with a directory of its own ...
    assert lines["variant vanilla"] == f"ran: {ppo_dir}"  # ... whose variant trained on in the killed run's directory
    metrics = json.loads((ppo_dir / "metrics.json").read_text())
    assert metrics["resumed_from"] >= max(checkpointed) >= CHECKPOINT_EVERY
    assert metrics["steps_completed"] == metrics["total_steps"] == PPO_STEPS
    steps = [json.loads(line)["step"] for line in (ppo_dir / "history.jsonl").read_text().splitlines()]
    assert steps == sorted(set(steps)) and steps[-1] == PPO_STEPS  # no iteration logged twice
    (row,) = json.loads((ablation_dir / "comparison" / "comparison.json").read_text())["rows"]
    assert row["variant"] == "vanilla" and row["resumed"] is True
    # judged, or (a tiny run that hands on its start, the SFT model) not evaluated with the reason recorded
    assert (row["judge_win_minus_lose"] is not None) != (row["not_evaluated"] is not None)
    claims = tmp_path / "runs" / ".cache" / "in_progress"
    assert not claims.exists() or not any(claims.iterdir())  # the finished variant released its claim
