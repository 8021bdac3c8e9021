"""The MLflow Model Registry: registering models, and promotion of the challenger through the gate."""
