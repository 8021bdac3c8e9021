"""Scale-out across processes: rank context, data sharding, collectives, DeepSpeed configs and the launcher.

A stage runs in one process by default. With `distributed.num_processes > 1` the orchestration layer
starts it under the `deepspeed` launcher (`launcher.py`); every rank runs `python -m
rlhf_core.stages.worker <stage>` and trains its shard of every optimizer step's samples
(`sharding.py`) through a DeepSpeed ZeRO engine (rlhf_core/training/deepspeed_update.py and
rlhf_core/ppo/deepspeed_learner.py, configs rendered by `deepspeed_config.py`),
with the statistics that span the whole batch summed across ranks (`collectives.py`). Only rank 0 logs
and writes outputs. Nothing here imports deepspeed unless a process group of more than one rank is used,
and nothing here imports the training loop or the stages: this package is the layer below them.
"""
