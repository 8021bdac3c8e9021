"""The `rlhf sft`, `rlhf train-rm`, `rlhf judge-rm` and `rlhf score-pairs` subcommands (registered in
rlhf_cli/main.py).

They follow the CLI's conventions: `--config FILE` overlays (repeatable), `-s key.path=value` overrides
(repeatable), `--params FILE`, `--out DIR` (default `artifacts/<stage>/`). Stage code
is imported inside each command so `rlhf --help` stays fast.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from rlhf_cli.launching import TrainingOptions, run_training_command, start_training_command
from rlhf_cli.options import (
    ConfigOption,
    DataDirOption,
    OutOption,
    ParamsOption,
    RestartOption,
    SetOption,
    SftDirOption,
    resolve_config,
)
from rlhf_core.layout import default_output_dir
from rlhf_core.training.host_allocator import keep_freed_memory


def _resumed_note(metrics: dict[str, float]) -> str:
    resumed = int(metrics.get("resumed_from", 0))
    return f" (resumed from checkpoint step {resumed})" if resumed else ""


def _selection_note(metrics: dict[str, float]) -> str:
    """A reward model's selection: its best step and validation accuracy with the 95% interval."""
    return (
        f"best step {int(metrics['best_step'])}: validation accuracy {metrics['val/accuracy']:.3f} "
        f"(95% CI {metrics['val/accuracy_low']:.3f}-{metrics['val/accuracy_high']:.3f}) "
        f"on {int(metrics['val/pairs'])} pairs"
    )


def sft(
    data_dir: DataDirOption = default_output_dir("prepare-data"),
    config: ConfigOption = None,
    set_: SetOption = None,
    params: ParamsOption = Path("params.yaml"),
    out: OutOption = None,
    restart: RestartOption = False,
) -> None:
    """Supervised fine-tuning on prompt + chosen reply (loss on the reply tokens only)."""
    from rlhf_core.stages.sft import run_sft

    result = run_training_command(
        "sft", TrainingOptions(params, config, set_, out, restart), run_sft, data_dir=data_dir
    )
    metrics = result.metrics
    verb = "handed on the base model untrained" if metrics["skipped"] else f"trained {int(metrics['steps'])} steps"
    typer.echo(
        f"sft: {verb}{_resumed_note(metrics)}; held-out reply perplexity "
        f"{metrics['perplexity_before']:.3f} -> {metrics['perplexity_after']:.3f} "
        f"on {int(metrics['heldout_examples'])} replies; model in {result.model_dir}"
    )


def train_rm(
    data_dir: DataDirOption = default_output_dir("prepare-data"),
    sft_dir: SftDirOption = default_output_dir("sft"),
    config: ConfigOption = None,
    set_: SetOption = None,
    params: ParamsOption = Path("params.yaml"),
    out: OutOption = None,
    restart: RestartOption = False,
) -> None:
    """Train the reward model (ranking loss + beta_rm * LM loss); keep the best by validation accuracy."""
    from rlhf_core.stages.reward import run_train_rm

    options = TrainingOptions(params, config, set_, out, restart)
    result = run_training_command("reward", options, run_train_rm, data_dir=data_dir, sft_dir=sft_dir)
    metrics = result.metrics
    typer.echo(
        f"train-rm: trained {int(metrics['steps'])} steps on {int(metrics['train_pairs'])} pairs"
        f"{_resumed_note(metrics)}; {_selection_note(metrics)}, mean margin {metrics['val/margin_mean']:.3f}; "
        f"model in {result.model_dir}"
    )


def judge_rm(
    data_dir: DataDirOption = default_output_dir("prepare-data"),
    config: ConfigOption = None,
    set_: SetOption = None,
    params: ParamsOption = Path("params.yaml"),
    out: OutOption = None,
    restart: RestartOption = False,
) -> None:
    """Train the independent judge reward model on the PPO-prompt split (from the base model) to judge with."""
    from rlhf_core.stages.judge_reward import run_judge_rm

    resolved, out_dir = start_training_command("judge-reward", TrainingOptions(params, config, set_, out, restart))
    keep_freed_memory()  # this process trains now (rlhf_core/training/host_allocator.py)
    metrics = run_judge_rm(resolved, data_dir, out_dir).metrics
    typer.echo(
        f"judge-rm: trained {int(metrics['steps'])} steps on {int(metrics['train_pairs'])} pairs of the PPO-prompt "
        f"split{_resumed_note(metrics)}; {_selection_note(metrics)}; judge with `rlhf eval --rm-dir {out_dir}`"
    )


def score_pairs(
    model: Annotated[Path, typer.Option("--model", metavar="DIR", help="A train-rm output directory or its model/.")],
    data: Annotated[
        str, typer.Option("--data", metavar="SOURCE", help="A preference file, a directory of them, or a Hub id.")
    ],
    config: ConfigOption = None,
    set_: SetOption = None,
    params: ParamsOption = Path("params.yaml"),
    out: OutOption = None,
) -> None:
    """Score every pair of a file with a trained reward model; print accuracy and its 95% interval, and the
    skill beyond length (balanced and length-matched accuracy, docs/stages-sft-rm.md)."""
    from rlhf_core.stages.score_pairs import score_pair_file

    resolved = resolve_config(params, config, set_)
    result = score_pair_file(resolved, model, data, out)
    left_out = f"; left out {result.rows_dropped} unreadable rows and {result.pairs_too_long} too-long pairs"
    typer.echo(f"score-pairs: {result.accuracy.describe()}; {result.length.describe()}{left_out}")
