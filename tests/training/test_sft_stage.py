"""The sft stage on the tiny model: outputs per the stage contract, resume, the skip switch, the CLI."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from fixtures.commands import RLHF_COMMAND
from fixtures.library_output import library_output, run_with_terminal_stderr, without_quiet_switches
from fixtures.paths import PARAMS, ROOT, TINY
from fixtures.tiny_ppo import tiny_config, write_prepared_data
from rlhf_core.models.base import load_base_model
from rlhf_core.models.loading import load_causal_lm
from rlhf_core.sft.plots import CURVES_FILE, points, read_history
from rlhf_core.stages.sft import run_sft
from rlhf_core.stages.training_run import ResumeMismatchError
from rlhf_core.training.checkpoint import complete_checkpoints

pytestmark = pytest.mark.usefixtures("one_thread")


def hh_rows(count: int) -> list[dict[str, str]]:
    """HH transcripts; every third one is multi-turn, so the SFT mask meets earlier assistant turns."""
    rows = []
    for i in range(count):
        earlier = f"\n\nHuman: Hello number {i}.\n\nAssistant: Hi! What can I do?" if i % 3 == 0 else ""
        prompt = f"{earlier}\n\nHuman: How should I look after plant {i}?"
        rows.append(
            {
                "chosen": f"{prompt}\n\nAssistant: Water plant {i} weekly and give it light.",
                "rejected": f"{prompt}\n\nAssistant: Forget plant {i}.",
            }
        )
    return rows


@pytest.fixture(scope="module")
def multi_turn_data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Not the shared `data_dir`: multi-turn transcripts, so the SFT loss mask meets earlier assistant turns."""
    return write_prepared_data(tmp_path_factory.mktemp("sft-data"), hh_rows(80))


class RecordingLogger:
    """A caller's logger: keeps what the stage sends it."""

    def __init__(self) -> None:
        self.steps: list[tuple[int, dict[str, float]]] = []
        self.params: dict[str, Any] = {}
        self.closed = False

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.steps.append((step, dict(metrics)))

    def log_params(self, params: dict[str, Any]) -> None:
        self.params.update(params)

    def close(self) -> None:
        self.closed = True


@pytest.fixture(scope="module")
def first_run(
    multi_turn_data_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, dict[str, float], RecordingLogger]:
    out = tmp_path_factory.mktemp("sft-run") / "sft"
    logger = RecordingLogger()
    result = run_sft(tiny_config(), multi_turn_data_dir, out, logger=logger)
    assert result.out_dir == out and result.model_dir == out / "model"
    return out, result.metrics, logger


def test_sft_writes_model_metrics_history_and_checkpoints(
    first_run: tuple[Path, dict[str, float], RecordingLogger],
) -> None:
    out, metrics, logger = first_run
    assert json.loads((out / "metrics.json").read_text()) == pytest.approx(metrics)
    assert metrics["skipped"] == 0 and metrics["steps"] == 4 and metrics["resumed_from"] == 0
    assert metrics["train_examples"] > 0 and metrics["heldout_examples"] > 0
    assert metrics["perplexity_after"] < metrics["perplexity_before"]  # lr 1e-3 on the tiny model
    history = [json.loads(line) for line in (out / "history.jsonl").read_text().splitlines()]
    assert [row["step"] for row in history] == [1, 2, 3, 4]
    assert [row["progress"] for row in history] == [0.25, 0.5, 0.75, 1.0]
    assert history[-1]["val/perplexity"] == pytest.approx(metrics["perplexity_after"])
    assert [step for step, _ in logger.steps] == [1, 2, 3, 4] and not logger.closed
    assert logger.params["sft"]["max_steps"] == 4
    assert [p.name for p in complete_checkpoints(out / "checkpoints")] == ["step-00000002", "step-00000004"]


def test_length_grouped_batching_trains_as_many_steps_and_learns(multi_turn_data_dir: Path, tmp_path: Path) -> None:
    metrics = run_sft(tiny_config("sft.batching=length_grouped"), multi_turn_data_dir, tmp_path / "sft").metrics
    assert metrics["steps"] == 4 and metrics["perplexity_after"] < metrics["perplexity_before"]
    params = json.loads((tmp_path / "sft" / "history.params.json").read_text())
    assert params["sft"]["batching"] == "length_grouped"


def test_sft_plots_training_loss_and_heldout_perplexity_over_the_steps(
    first_run: tuple[Path, dict[str, float], RecordingLogger],
) -> None:
    out, metrics, _ = first_run
    assert (out / CURVES_FILE).read_bytes()[:4] == b"\x89PNG"
    history = read_history(out / "history.jsonl")
    assert points(history, "loss")[0] == [1, 2, 3, 4]
    steps, perplexities = points(history, "val/perplexity")
    assert steps[-1] == 4 and perplexities[-1] == pytest.approx(metrics["perplexity_after"])


def test_sft_model_is_a_hugging_face_chat_model_with_the_trained_weights(
    first_run: tuple[Path, dict[str, float], RecordingLogger],
) -> None:
    out, _, _ = first_run
    model, tokenizer = load_causal_lm(out / "model")
    assert tokenizer.chat_template is not None
    assert model.generation_config.eos_token_id == [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    final = load_file(str(out / "checkpoints" / "step-00000004" / "model.safetensors"))
    for name, tensor in model.state_dict().items():
        if name in final:
            assert torch.equal(tensor, final[name]), name


def test_rerun_resumes_from_the_last_checkpoint_without_recomputing_the_baseline(
    first_run: tuple[Path, dict[str, float], RecordingLogger], multi_turn_data_dir: Path
) -> None:
    out, metrics, _ = first_run
    again = run_sft(tiny_config(), multi_turn_data_dir, out).metrics
    assert again["resumed_from"] == 4 and again["steps"] == 4
    assert again["perplexity_before"] == metrics["perplexity_before"]  # restored from the checkpoint
    assert again["perplexity_after"] == pytest.approx(metrics["perplexity_after"])
    history = [json.loads(line)["step"] for line in (out / "history.jsonl").read_text().splitlines()]
    assert history == [1, 2, 3, 4]


def test_changed_settings_refuse_to_resume_naming_the_change_and_keep_the_output_finished(
    first_run: tuple[Path, dict[str, float], RecordingLogger], multi_turn_data_dir: Path
) -> None:
    out, _, _ = first_run
    finished = (out / "metrics.json").read_text()
    with pytest.raises(ResumeMismatchError, match=r"other settings or inputs: sft\.lr: 0\.001 -> 0\.002\."):
        run_sft(tiny_config("sft.lr=0.002"), multi_turn_data_dir, out)
    assert (out / "metrics.json").read_text() == finished  # refused before touching the output


def test_skip_hands_on_the_base_model_and_records_it(multi_turn_data_dir: Path, tmp_path: Path) -> None:
    config = tiny_config("sft.skip=true")
    result = run_sft(config, multi_turn_data_dir, tmp_path / "sft")
    metrics = result.metrics
    assert metrics["skipped"] == 1 and metrics["steps"] == 0
    assert metrics["perplexity_before"] == metrics["perplexity_after"]
    assert not (tmp_path / "sft" / "checkpoints").exists()
    saved, _ = load_causal_lm(tmp_path / "sft" / "model")
    base, _ = load_base_model(config.model)
    for (name, tensor), expected in zip(saved.state_dict().items(), base.state_dict().values(), strict=True):
        assert torch.equal(tensor, expected), name


def test_a_missing_data_dir_is_named_before_any_model_loads(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nowhere"):
        run_sft(tiny_config(), tmp_path / "nowhere", tmp_path / "sft")


def rlhf_sft_command(data_dir: Path, out: Path) -> list[str]:
    """`rlhf sft` on the tiny model for 2 steps, runnable from any directory."""
    return [
        *RLHF_COMMAND,
        "sft",
        "--params",
        str(PARAMS),
        "-c",
        str(TINY),
        "-s",
        "sft.max_steps=2",
        "--data-dir",
        str(data_dir),
        "--out",
        str(out),
    ]


def command_env(**extra: str) -> dict[str, str]:
    """This environment as a new user has it, with this checkout's code first on the path (the command runs
    in tmp_path, outside it)."""
    return without_quiet_switches(dict(os.environ)) | {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)} | extra


@pytest.mark.slow
def test_rlhf_sft_command_with_stderr_in_a_file(multi_turn_data_dir: Path, tmp_path: Path) -> None:
    """The summary on stdout, nothing on the redirected stderr: DeepSpeed does not warn, transformers'
    "Writing model shards" bar is off, other libraries' messages are in the log file the command names."""
    stderr_file = tmp_path / "stderr.txt"
    with stderr_file.open("w") as stderr:
        result = subprocess.run(
            rlhf_sft_command(multi_turn_data_dir, tmp_path / "sft"),
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            timeout=300,
            env=command_env(),
        )
    assert result.returncode == 0, stderr_file.read_text()
    assert "sft: trained 2 steps" in result.stdout and "held-out reply perplexity" in result.stdout
    assert json.loads((tmp_path / "sft" / "metrics.json").read_text())["steps"] == 2
    assert stderr_file.read_text() == ""
    # DS_ACCELERATOR=cpu keeps DeepSpeed from warning at all here (rlhf_cli/quiet_libraries.py); any other
    # library message goes to the log file the summary names
    assert "Setting accelerator" not in result.stdout
    for log_line in [line for line in result.stdout.splitlines() if line.startswith("other libraries' messages")]:
        log = tmp_path / log_line.rsplit(": ", 1)[1]
        assert log.parent == tmp_path / "runs" / "logs" and log.name.startswith("rlhf-sft-")


@pytest.mark.slow
@pytest.mark.parametrize("quiet", ["", "1"])
def test_on_a_terminal_rlhf_quiet_turns_the_libraries_bars_off_too(
    multi_turn_data_dir: Path, tmp_path: Path, quiet: str
) -> None:
    """On a terminal transformers draws its bar, as the project draws its own; RLHF_QUIET=1 turns both off
    (the libraries' bars once came through). DeepSpeed's warning goes to the log file either way."""
    status, stdout, terminal = run_with_terminal_stderr(
        rlhf_sft_command(multi_turn_data_dir, tmp_path / "sft"), tmp_path, command_env(RLHF_QUIET=quiet), timeout_s=300
    )
    assert status == 0, terminal
    assert "sft: trained 2 steps" in stdout
    if quiet:
        assert library_output(terminal) == [], terminal
    else:
        assert "Writing model shards" in terminal and "it/s" in terminal
    assert "Setting accelerator" not in terminal + stdout
