"""An ablation's Prefect tasks: the shared base and one PPO run per variant, evaluated and compared."""
