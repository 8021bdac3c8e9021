"""`rlhf sft` with `distributed.num_processes=2` launches two ranks (the real deepspeed launcher, gloo on
CPU), prints both ranks' lines, and ends with the same summary as a single-process run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from fixtures.paths import PARAMS, TINY
from fixtures.servers import free_port
from fixtures.tiny_ppo import hh_pair, tiny_config
from rlhf_cli import stage_commands
from rlhf_core.stages.prepare_data import run_prepare_data

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.slow
def test_sft_command_launches_the_configured_processes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = tmp_path / "pairs.jsonl"
    source.write_text("".join(json.dumps(hh_pair(i)) + "\n" for i in range(60)))
    run_prepare_data(tiny_config(), tmp_path / "data", source=str(source))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    app = typer.Typer()
    app.command("sft")(stage_commands.sft)
    app.command("unused")(stage_commands.score_pairs)  # two commands: typer keeps the subcommand name

    result = CliRunner().invoke(
        app,
        [
            "sft",
            "--params", str(PARAMS),
            "--config", str(TINY),
            "-s", "sft.max_steps=2", "-s", "sft.micro_batch_size=2", "-s", "sft.grad_accum_steps=1",
            "-s", "distributed.num_processes=2", "-s", f"distributed.master_port={free_port()}",
            "--data-dir", str(tmp_path / "data"),
            "--out", str(tmp_path / "sft"),
        ],
    )  # fmt: skip

    assert result.exit_code == 0, result.output[-3000:]
    assert "[rank 0] " in result.output and "[rank 1] " in result.output
    metrics = json.loads((tmp_path / "sft" / "metrics.json").read_text())
    assert metrics["steps"] == 2
    assert "sft: trained 2 steps; held-out reply perplexity" in result.stdout
    assert (tmp_path / "sft" / "model" / "model.safetensors").is_file()
