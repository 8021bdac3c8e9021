"""The registered models as MLflow pyfuncs: the chat policy, its request checks, and the reward scorer."""
