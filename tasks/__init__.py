"""Prefect tasks, one per pipeline stage: thin wrappers over rlhf_core.stages that own tracking, caching and retries."""
