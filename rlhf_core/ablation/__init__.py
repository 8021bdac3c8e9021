"""Ablations (paper Figures 4-9): PPO variants of one base, compared side by side.

- `grid`: the grid file (named variants, each a preset plus `ppo.*` overrides) and how each variant's
  configuration is resolved from the base configuration; every variant is validated before anything runs.
- `comparison`: what the comparison reads of each variant (its own metrics.json, history.jsonl and
  evaluation) and the table rows made from it.
- `plots`: the paper's Figure 4 monitors of every variant overlaid, and the outcomes with intervals.
- `summary`: the markdown summary; `report` writes all of it into one directory.

The orchestration (Prefect tasks, MLflow runs) is in tasks/ablation/variant_tasks.py and flows/ablation.py.
"""
