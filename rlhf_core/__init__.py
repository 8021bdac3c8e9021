"""The pure ML library: PPO-max RLHF with PyTorch and transformers (no Prefect, MLflow or DVC)."""
