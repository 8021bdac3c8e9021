"""The `rlhf` command-line interface (the top layer: it may import flows, tasks and rlhf_core)."""
