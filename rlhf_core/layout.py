"""The file names of a stage's output directory, in one leaf module every layer can import.

A stage writes its outputs under its `out_dir` and `metrics.json` LAST (the stage is complete exactly when
it exists); training stages add `model/` (the handed-on model), `history.jsonl` and `checkpoints/`; PPO
adds `selection.json` (which validated policy it handed on, and why) and `plots/`. README "Stages" and
each stage's doc describe the contents.
"""

METRICS_FILE = "metrics.json"
MODEL_DIR = "model"
HISTORY_FILE = "history.jsonl"
CHECKPOINTS_DIR = "checkpoints"
PLOTS_DIR = "plots"
SELECTION_FILE = "selection.json"
