"""Prefect flows chaining the stage tasks, and the deployments that schedule and serve them."""
