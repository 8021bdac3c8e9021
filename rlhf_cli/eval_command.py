"""The `rlhf eval` subcommand (registered at the end of rlhf_cli/main.py).

    rlhf eval --a artifacts/ppo --b artifacts/sft [--judge rm|llm] [--rm-dir artifacts/reward]
    rlhf eval --a models:/rlhf-policy@challenger --b models:/rlhf-policy@champion

A model (`--a`, `--b`, `--rm-dir`) is a stage output or model directory, or an MLflow registry URI
(`models:/name@alias`, `models:/name/3`) on the tracking store MLFLOW_TRACKING_URI (or
tracking.tracking_uri) names, downloaded once into the model cache, `$RLHF_CACHE_DIR/registry/`
(default ~/.cache/rlhf-pipeline/registry/; tasks/evaluation/evaluate_task.py), not into the working tree.
Models A and B that are the same model by content (the sha256 of their model files, as registered) are
refused (exit status 3, rlhf_cli/exit_codes.py): every pair would be a tie. `--allow-same` evaluates
them anyway, with a warning.
When a model is a `models:/` URI (model A's, else B's) and `--data-dir` or, for the reward-model judge,
`--rm-dir` is not given, they come from that version's lineage tags (tasks/promotion/eval_lineage.py): the
prepared data it was trained on and the judge reward model registered with it; the command prints
which. Otherwise they default to `artifacts/data` and `artifacts/reward`.
Whether a reward-model judge is in-sample is read from model A's record of the reward model PPO
optimised against; `--rm-independent` vouches for a model A without such a record.

It takes the CLI's shared options (`--config`, `-s`, `--params`, `--out`, default `artifacts/eval/`),
defined once in stage_commands.py. The judge defaults to `evaluation.judge` in params.yaml (the reward
model). `--judge llm` reads its endpoint from RLHF_JUDGE_BASE_URL, RLHF_JUDGE_MODEL and
RLHF_JUDGE_API_KEY (or OPENAI_API_KEY). `--judge human` is the rlhf-human-eval Prefect flow's job; the
command says so and stops. The stage is imported inside the command so `rlhf --help` stays fast.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from rlhf_cli.exit_codes import REFUSED_EXIT_CODE
from rlhf_cli.options import ConfigOption, OutOption, ParamsOption, SetOption, resolve_config, stage_dir
from rlhf_core.config import Config
from rlhf_core.layout import default_output_dir

MODELS_URI_PREFIX = "models:/"
REGISTRY_CACHE_SUBDIR = Path("registry")  # under $RLHF_CACHE_DIR, beside the converted packaged models
DEFAULT_DATA_DIR = default_output_dir("prepare-data")
DEFAULT_RM_DIR = str(default_output_dir("reward"))
SAME_MODEL = "model A and model B are the same model (content sha256 {}): every pair would be a tie"


def registry_cache() -> Path:
    """Where `models:/` URIs are downloaded: the model cache (rlhf_core/models/gguf_cache.py), not the
    working tree."""
    from rlhf_core.models.gguf_cache import default_cache_dir

    return default_cache_dir(REGISTRY_CACHE_SUBDIR)


def local_model(reference: str, config: Config) -> Path:
    """A directory as it is; a `models:/` URI downloaded from the MLflow registry (Prefect and MLflow are
    imported only then, so the common case stays fast)."""
    if not reference.startswith(MODELS_URI_PREFIX):
        return Path(reference)
    from tasks.registry.downloads import resolve_registered_model

    return resolve_registered_model(reference, config, registry_cache()).out_dir


def compared_model(reference: str, config: Config) -> tuple[Path, str]:
    """Model A's or B's local directory (`local_model`) and its content sha256: a directory's model files,
    or a download's as it was registered (tasks/registry/downloads.py `downloaded_model_sha256`)."""
    if not reference.startswith(MODELS_URI_PREFIX):
        from rlhf_core.evaluation.model_dirs import resolve_model_dir
        from rlhf_core.stage_outputs import directory_sha256

        return Path(reference), directory_sha256(resolve_model_dir(reference))
    from tasks.registry.downloads import resolve_registered_model

    output = resolve_registered_model(reference, config, registry_cache())
    return output.out_dir, output.sha256


def check_not_same(sha256_a: str, sha256_b: str, allow_same: bool) -> None:
    """Refuse two models with the same content (SAME_MODEL); with `allow_same`, warn on stderr instead."""
    if sha256_a != sha256_b:
        return
    message = SAME_MODEL.format(sha256_a[:12])
    if not allow_same:
        typer.echo(f"refused: {message}; pass --allow-same to evaluate anyway", err=True)
        raise typer.Exit(REFUSED_EXIT_CODE)
    typer.echo(f"warning: {message}; evaluating anyway (--allow-same)", err=True)


def chosen_judge(judge: str | None, config: Config) -> str:
    """`--judge`, else `evaluation.judge`; refused unless `rlhf eval` can run it (the human judge runs as a
    Prefect flow)."""
    from rlhf_core.stages.evaluate import HUMAN_JUDGE_MESSAGE, JUDGES

    chosen = judge or config.evaluation.judge
    if chosen == "human":
        raise typer.BadParameter(HUMAN_JUDGE_MESSAGE, param_hint="--judge")
    if chosen not in JUDGES:
        raise typer.BadParameter(f"{chosen!r} is not a judge; choose rm or llm", param_hint="--judge")
    return chosen


def check_registry_reachable(references: tuple[str, ...], config: Config) -> None:
    """When any reference is a `models:/` URI, check the registry's server answers, so an unreachable one
    fails in seconds rather than inside a download."""
    if any(reference.startswith(MODELS_URI_PREFIX) for reference in references):
        from tasks.preflight import tracking_services
        from tasks.services.probes import check_services

        check_services(tracking_services(config.tracking.tracking_uri, Path.cwd()))


def eval_inputs(
    models: tuple[str, str], data_dir: Path | None, rm_dir: str | None, judge: str, config: Config
) -> tuple[Path, str | None]:
    """The eval data and the reward-model judge: as given, else from the lineage of the first `models:/`
    model (printing what was taken from it), else the `artifacts/` defaults."""
    needs_judge = judge == "rm" and rm_dir is None
    registered = next((model for model in models if model.startswith(MODELS_URI_PREFIX)), None)
    if registered is not None and (data_dir is None or needs_judge):
        from tasks.promotion.eval_lineage import eval_lineage

        lineage = eval_lineage(registered, config, need_data=data_dir is None, need_judge=needs_judge)
        for line in lineage.describe():
            typer.echo(line)
        data_dir = data_dir or lineage.data_dir
        rm_dir = rm_dir or (lineage.judge.reference if lineage.judge is not None else None)
    if judge == "rm" and rm_dir is None:
        rm_dir = DEFAULT_RM_DIR
    return data_dir or DEFAULT_DATA_DIR, rm_dir if judge == "rm" else None


ModelAOption = Annotated[
    str,
    typer.Option("--a", metavar="MODEL", help="Model A, under evaluation (e.g. artifacts/ppo, models:/NAME@ALIAS)."),
]
ModelBOption = Annotated[
    str, typer.Option("--b", metavar="MODEL", help="Model B, the baseline (e.g. artifacts/sft, models:/NAME/VERSION).")
]
JudgeOption = Annotated[
    str | None, typer.Option("--judge", metavar="rm|llm", help="rm | llm (default: evaluation.judge in params.yaml).")
]
JudgeRmOption = Annotated[
    str | None,
    typer.Option(
        "--rm-dir",
        metavar="MODEL",
        help="The reward model judging (a train-rm output directory or models:/ URI; default: the judge "
        "registered with a models:/ model A or B, else artifacts/reward).",
    ),
]
RmIndependentOption = Annotated[
    bool,
    typer.Option(
        "--rm-independent",
        help="The judging reward model is NOT the one PPO optimised against (for a model A that does not "
        "record its reward model; e.g. one trained on a disjoint split).",
    ),
]
AllowSameOption = Annotated[
    bool, typer.Option("--allow-same", help="Evaluate even when A and B are the same model by content (all ties).")
]
AgreeWithOption = Annotated[
    list[Path] | None,
    typer.Option(
        "--agree-with", metavar="FILE", help="verdicts.jsonl of another judge on the same pairs (repeatable)."
    ),
]
EvalDataDirOption = Annotated[
    Path | None,
    typer.Option(
        "--data-dir",
        metavar="DIR",
        help="Prepared data (output of prepare-data; default: the data a models:/ model A or B was trained "
        "on, else artifacts/data).",
    ),
]


def eval_command(
    a: ModelAOption,
    b: ModelBOption,
    judge: JudgeOption = None,
    rm_dir: JudgeRmOption = None,
    rm_independent: RmIndependentOption = False,
    allow_same: AllowSameOption = False,
    agree_with: AgreeWithOption = None,
    data_dir: EvalDataDirOption = None,
    config: ConfigOption = None,
    set_: SetOption = None,
    params: ParamsOption = Path("params.yaml"),
    out: OutOption = None,
) -> None:
    """Compare model A with model B on the held-out prompts: win/tie/lose report and Figure 10 chart.

    Exit status 3: refused, A and B are the same model by content (--allow-same evaluates them anyway).
    """
    from rlhf_core.stages.evaluate import PLOT_FILE, REPORT_MD, run_evaluate

    resolved = resolve_config(params, config, set_)
    chosen = chosen_judge(judge, resolved)
    check_registry_reachable((a, b, rm_dir or ""), resolved)
    data, judge_rm = eval_inputs((a, b), data_dir, rm_dir, chosen, resolved)
    (dir_a, sha256_a), (dir_b, sha256_b) = compared_model(a, resolved), compared_model(b, resolved)
    check_not_same(sha256_a, sha256_b, allow_same)
    result = run_evaluate(
        resolved,
        data,
        dir_a,
        dir_b,
        stage_dir(out, "evaluate"),
        judge=chosen,
        rm_dir=local_model(judge_rm, resolved) if judge_rm is not None else None,
        rm_in_sample=False if rm_independent else None,
        other_verdicts=agree_with or [],
        names=(a, b),
    )
    metrics = result.metrics
    typer.echo((result.out_dir / REPORT_MD).read_text(encoding="utf-8"), nl=False)
    typer.echo(
        f"eval: {int(metrics['valid_pairs'])} of {int(metrics['pairs'])} pairs judged validly; report in "
        f"{result.out_dir / REPORT_MD}, chart in {result.out_dir / PLOT_FILE}"
    )
