"""The raw data a run starts from: its DVC version, `dvc add/push/pull`, and the data-pushed event."""
