"""Promotion through the MLflow registry: the promote flow's tasks, and what `rlhf eval` reads of a registered "
"model's lineage."""
