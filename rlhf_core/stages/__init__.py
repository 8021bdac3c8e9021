"""Pipeline stages as plain functions of a `Config` and paths: what the CLI, Prefect tasks and DVC run."""
