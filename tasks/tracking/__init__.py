"""MLflow tracking: the runs of a pipeline run, their lineage tags, the metrics logger, and which process owns a run."""
