"""The layout of the pipeline's outputs, in one leaf module every layer can import: where each stage's
output directory is, and the names of the files inside one.

Where: each stage writes its own directory, named in STAGE_DIRS, under a root: `artifacts/` for the
CLI's stage commands and `dvc repro` (dvc.yaml spells the same paths out), `runs/<id>/` for a pipeline
run (`rlhf run`, the Prefect flows).

What: a stage writes its outputs under its output directory and `metrics.json` LAST (the stage is
complete exactly when it exists); prepare-data adds `data_report.json`; training stages add `model/`
(the handed-on model), `history.jsonl` (with its `history.params.json`) and `checkpoints/`; PPO adds
`selection.json` (which validated policy it handed on, and why), `samples.jsonl` and `plots/`. README
"Stages" and each stage's doc describe the contents.
"""

from pathlib import Path

ARTIFACTS_DIR = Path("artifacts")  # the root the CLI's stage commands write under by default
RUNS_DIR = Path("runs")  # where pipeline runs (`rlhf run`, the flows) put their run directories by default
HUMAN_EVAL_DIR = ARTIFACTS_DIR / "human-eval"  # where the rlhf-human-eval deployment keeps its session

# Each stage's output directory inside a root (artifacts/, or a pipeline run's directory).
STAGE_DIRS = {
    "prepare-data": "data",
    "sft": "sft",
    "reward": "reward",
    "judge-reward": "judge_reward",
    "ppo": "ppo",
    "evaluate": "eval",
}

METRICS_FILE = "metrics.json"
DATA_REPORT_FILE = "data_report.json"
MODEL_DIR = "model"
HISTORY_FILE = "history.jsonl"
HISTORY_PARAMS_FILE = "history.params.json"
CHECKPOINTS_DIR = "checkpoints"
PLOTS_DIR = "plots"
SELECTION_FILE = "selection.json"
SAMPLES_FILE = "samples.jsonl"


def stage_output_dir(root: Path, stage: str) -> Path:
    """The output directory of `stage` under `root`: `root/<its directory in STAGE_DIRS>`."""
    return Path(root) / STAGE_DIRS[stage]


def default_output_dir(stage: str) -> Path:
    """Where a stage's CLI command writes, and where the commands after it read it, unless told otherwise:
    `artifacts/<its directory>`."""
    return stage_output_dir(ARTIFACTS_DIR, stage)
