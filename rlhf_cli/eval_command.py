"""The `rlhf eval` subcommand (registered at the end of rlhf_cli/main.py).

    rlhf eval --a artifacts/ppo --b artifacts/sft [--judge rm|llm] [--rm-dir artifacts/reward]

It takes the CLI's shared options (`--config`, `-s`, `--params`, `--out`, default `artifacts/eval/`),
defined once in stage_commands.py. The judge defaults to `evaluation.judge` in params.yaml (the reward
model). `--judge llm` reads its endpoint from RLHF_JUDGE_BASE_URL, RLHF_JUDGE_MODEL and
RLHF_JUDGE_API_KEY (or OPENAI_API_KEY). `--judge human` is the rlhf-human-eval Prefect flow's job; the
command says so and stops. The stage is imported inside the command so `rlhf --help` stays fast.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from rlhf_cli.options import ConfigOption, DataDirOption, OutOption, ParamsOption, SetOption, resolve_config


def eval_command(
    a: Annotated[Path, typer.Option("--a", help="Model A, under evaluation (e.g. artifacts/ppo).")],
    b: Annotated[Path, typer.Option("--b", help="Model B, the baseline (e.g. artifacts/sft).")],
    judge: Annotated[
        Optional[str], typer.Option("--judge", help="rm | llm (default: evaluation.judge in params.yaml).")
    ] = None,
    rm_dir: Annotated[
        Path, typer.Option("--rm-dir", help="The reward model judging (a train-rm output directory).")
    ] = Path("artifacts/reward"),
    rm_independent: Annotated[
        bool,
        typer.Option(
            "--rm-independent",
            help="The judging reward model is NOT the one PPO optimised against (e.g. trained on a disjoint split).",
        ),
    ] = False,
    agree_with: Annotated[
        Optional[list[Path]],
        typer.Option("--agree-with", help="verdicts.jsonl of another judge on the same pairs (repeatable)."),
    ] = None,
    data_dir: DataDirOption = Path("artifacts/data"),
    config: ConfigOption = None,
    set_: SetOption = None,
    params: ParamsOption = Path("params.yaml"),
    out: OutOption = None,
) -> None:
    """Compare model A with model B on the held-out prompts: win/tie/lose report and Figure 10 chart."""
    from rlhf_core.stages.evaluate import HUMAN_JUDGE_MESSAGE, JUDGES, PLOT_FILE, REPORT_MD, run_evaluate

    resolved = resolve_config(params, config, set_)
    chosen = judge or resolved.evaluation.judge
    if chosen == "human":
        raise typer.BadParameter(HUMAN_JUDGE_MESSAGE, param_hint="--judge")
    if chosen not in JUDGES:
        raise typer.BadParameter(f"{chosen!r} is not a judge; choose rm or llm", param_hint="--judge")
    result = run_evaluate(
        resolved,
        data_dir,
        a,
        b,
        out if out is not None else Path("artifacts/eval"),
        judge=chosen,
        rm_dir=rm_dir if chosen == "rm" else None,
        rm_in_sample=not rm_independent,
        other_verdicts=agree_with or [],
    )
    metrics = result.metrics
    typer.echo((result.out_dir / REPORT_MD).read_text(encoding="utf-8"), nl=False)
    typer.echo(
        f"eval: {int(metrics['valid_pairs'])} of {int(metrics['pairs'])} pairs judged validly; report in "
        f"{result.out_dir / REPORT_MD}, chart in {result.out_dir / PLOT_FILE}"
    )
