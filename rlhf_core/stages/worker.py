"""The program every rank of a launched stage runs: `python -m rlhf_core.stages.worker <stage> ...`.

`launcher.py` starts it under the `deepspeed` launcher; it can also be started by hand (multi-node
runs, debugging), for example

    rlhf config show -c configs/paper-7b.yaml > resolved.yaml
    deepspeed --num_gpus 8 --no_local_rank --module rlhf_core.stages.worker \
        sft --config resolved.yaml --data-dir artifacts/data --out artifacts/sft

`--config` is a fully resolved configuration (YAML or JSON, as `rlhf config show` prints it), validated
here like any other. Each rank runs the stage function itself (rlhf_core/stages); the stage shards the
data by rank and only rank 0 writes outputs. An exception is recorded for the launcher
(`rank_errors.py`) and ends the process with a non-zero status.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from pathlib import Path
from typing import Any

from rlhf_core.config import read_yaml_mapping, validate_config
from rlhf_core.distributed.context import end_rank_process, leave_process_group, rank_context
from rlhf_core.distributed.rank_errors import recording_rank_errors
from rlhf_core.stages.result import StageResult
from rlhf_core.training.host_allocator import keep_freed_memory

log = logging.getLogger(__name__)
STAGES = ("sft", "reward", "ppo", "judge-reward")
LOG_LEVEL_ENV = "RLHF_LOG_LEVEL"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The stage and its inputs; which directories a stage needs is checked in `run_stage`."""
    parser = argparse.ArgumentParser(prog="python -m rlhf_core.stages.worker", description=__doc__)
    parser.add_argument("stage", choices=STAGES)
    parser.add_argument("--config", type=Path, required=True, help="A fully resolved configuration file.")
    parser.add_argument("--data-dir", type=Path, required=True, help="The prepare-data output.")
    parser.add_argument("--sft-dir", type=Path, help="The SFT output (reward, ppo).")
    parser.add_argument("--rm-dir", type=Path, help="The reward-model output (ppo).")
    parser.add_argument("--out", type=Path, required=True, help="The stage's output directory.")
    return parser.parse_args(argv)


def read_resolved_config(path: Path) -> dict[str, Any]:
    """The mapping in a `.json` file (what `launcher.launch_stage` writes), else in a YAML file.

    JSON is read as JSON: PyYAML reads a JSON number such as `1e-06` as a string.
    """
    if path.suffix == ".json":
        return json.loads(path.read_text(encoding="utf-8"))
    return read_yaml_mapping(path)


def run_stage(args: argparse.Namespace) -> StageResult:
    """Run one stage function in this rank."""
    config = validate_config(read_resolved_config(args.config))
    if args.stage == "sft":
        from rlhf_core.stages.sft import run_sft

        return run_sft(config, args.data_dir, args.out)
    if args.stage == "reward":
        from rlhf_core.stages.reward import run_train_rm

        return run_train_rm(config, args.data_dir, args.sft_dir, args.out)
    if args.stage == "judge-reward":  # one process, beside SFT and the reward model (flows/pipeline.py)
        from rlhf_core.stages.judge_reward import run_judge_rm

        return run_judge_rm(config, args.data_dir, args.out)
    if args.sft_dir is None or args.rm_dir is None:
        raise ValueError("the ppo stage needs --sft-dir and --rm-dir")
    from rlhf_core.stages.ppo import run_ppo

    return run_ppo(config, args.data_dir, args.sft_dir, args.rm_dir, args.out)


def main(argv: list[str] | None = None) -> None:
    """Run the stage on this rank; `RLHF_LOG_LEVEL=DEBUG` also logs which examples each rank trains on."""
    context = rank_context()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("rlhf_core").setLevel(os.environ.get(LOG_LEVEL_ENV, "INFO"))
    log.info("rank %d of %d (local rank %d) starting", context.rank, context.world_size, context.local_rank)
    keep_freed_memory()
    with recording_rank_errors():
        args = parse_args(argv)
        result = run_stage(args)
        leave_process_group()
    if context.is_main:
        log.info("stage %s finished: outputs in %s", args.stage, result.out_dir)
    end_rank_process()


if __name__ == "__main__":
    main()
