"""The `rlhf ppo` subcommand (registered at the end of rlhf_cli/main.py).

It follows the CLI's conventions: `--config FILE` overlays (repeatable), `-s key.path=value` overrides
(repeatable), `--params FILE`, `--out DIR` (default `artifacts/ppo/`), with the option types of
rlhf_cli/options.py. The stage is imported inside the command so `rlhf --help` stays fast.
"""

from __future__ import annotations

from pathlib import Path

import typer

from rlhf_cli.launching import TrainingOptions, run_training_command
from rlhf_cli.options import (
    ConfigOption,
    DataDirOption,
    OutOption,
    ParamsOption,
    RestartOption,
    RmDirOption,
    SetOption,
    SftDirOption,
)
from rlhf_core.layout import default_output_dir


def ppo(
    data_dir: DataDirOption = default_output_dir("prepare-data"),
    sft_dir: SftDirOption = default_output_dir("sft"),
    rm_dir: RmDirOption = default_output_dir("reward"),
    config: ConfigOption = None,
    set_: SetOption = None,
    params: ParamsOption = Path("params.yaml"),
    out: OutOption = None,
    restart: RestartOption = False,
) -> None:
    """PPO-max against the reward model; the output is the validated policy the selection rule chose."""
    from rlhf_core.stages.ppo import guard_message, run_ppo

    options = TrainingOptions(params, config, set_, out, restart)
    result = run_training_command("ppo", options, run_ppo, data_dir=data_dir, sft_dir=sft_dir, rm_dir=rm_dir)
    metrics = result.metrics
    message = guard_message(result.out_dir)
    if message is not None:
        typer.echo(f"ppo: {message}; handing on the best policy validated before the stop", err=True)
    typer.echo(
        f"ppo: {int(metrics['steps_completed'])} of {int(metrics['total_steps'])} iterations; best policy "
        f"at step {int(metrics['best_step'])}: validation reward "
        f"{metrics['val/reward_initial']:.4f} (SFT) -> {metrics['val/reward_best']:.4f}, "
        f"per-token KL {metrics['val/kl_best']:.4f}; model in {result.model_dir}"
    )
