"""The pipeline's stage tasks, and what one attempt of a stage runs in: its MLflow run, outputs, reports and "
"registration."""
