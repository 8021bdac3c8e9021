"""What each rank runs in tests/distributed/test_distributed_zero3_gather.py: PPO rollouts of a ZeRO-3 policy.

Builds the PPO trainer of the stage (tiny SFT and reward-model outputs given on the command line) on a
2-rank ZeRO-3 process group, with the rollout engine `--engine` names, and counts, per rollout, how many
times the policy's weights are gathered whole (`GatheredParameters` entered) and how many all-gather
collectives run DURING the engine's `generate`; between the rollouts the policy takes an update step. As
a control it also generates once without the whole-model gather, where ZeRO-3 fetches every layer's
weights again for every new token, and it checks that the engine, synced after the update, draws the
tokens `generate` draws from the gathered, updated policy. Prints one line `ZERO3 <json>` per rank.
"""

import argparse
import collections
import json
from pathlib import Path

import torch
from deepspeed.comm import comm as ds_comm
from deepspeed.runtime.zero import GatheredParameters

from rlhf_core.config import load_config
from rlhf_core.distributed.context import leave_process_group, stage_context
from rlhf_core.ppo.trainer import PPOTrainer
from rlhf_core.rollout.engine import HFGenerateEngine
from rlhf_core.rollout.generation import generate_responses, left_pad, sampling_config
from rlhf_core.rollout.lean_engine import LeanEngine
from rlhf_core.stages.ppo import load_ppo_data, load_ppo_models

ROOT = Path(__file__).resolve().parents[2]
counts: collections.Counter[str] = collections.Counter()


def count_calls(owner: object, name: str, counter: str) -> None:
    """Wrap `owner.name` so that every call adds 1 to `counts[counter]`."""
    original = getattr(owner, name)

    def counted(*args, **kwargs):
        counts[counter] += 1
        return original(*args, **kwargs)

    setattr(owner, name, counted)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data-dir", type=Path, required=True)
    parser.add_argument("--sft-dir", type=Path, required=True)
    parser.add_argument("--rm-dir", type=Path, required=True)
    parser.add_argument("--rollouts", type=int, required=True)
    parser.add_argument("--engine", choices=["hf", "lean"], required=True)
    args = parser.parse_args()
    config = load_config(
        ROOT / "params.yaml",
        overlays=[ROOT / "configs" / "tiny.yaml"],
        overrides=[
            "distributed.num_processes=2",
            "distributed.zero_stage=3",
            "ppo.ptx_coef=0",
            "ppo.rollout.max_new_tokens=8",
            f"ppo.rollout.engine={args.engine}",
            "ppo.rollout.sampler=multinomial",  # generate's draws: the engine's tokens are compared with its
        ],
    )
    context = stage_context(config.distributed)
    models, tokenizer = load_ppo_models(config, args.sft_dir, args.rm_dir, torch.device("cpu"))
    trainer = PPOTrainer(
        models,
        tokenizer,
        load_ppo_data(config, args.data_dir),
        config.ppo,
        config.seed,
        distributed=config.distributed,
    )
    for name in ("all_gather", "all_gather_into_tensor", "all_gather_coalesced", "allgather_fn"):
        if hasattr(ds_comm.cdb, name):
            count_calls(ds_comm.cdb, name, "all_gather")
    count_calls(GatheredParameters, "__enter__", "whole_model_gathers")
    policy = trainer.models.policy
    during_generate: list[int] = []

    def counted(generate):
        def counted_generate(*generate_args, **generate_kwargs):
            before = counts["all_gather"]
            output = generate(*generate_args, **generate_kwargs)
            during_generate.append(counts["all_gather"] - before)
            return output

        return counted_generate

    engine_class = LeanEngine if args.engine == "lean" else HFGenerateEngine
    engine_class.generate = counted(engine_class.generate)
    rollouts = []
    for step in range(1, args.rollouts + 1):
        before = counts["whole_model_gathers"]
        experience, _ = trainer.rollout(step)
        rollouts.append(
            {
                "whole_model_gathers": counts["whole_model_gathers"] - before,
                "all_gathers_during_generate": during_generate[-1],
                "generated_columns": int(experience.response_ids.shape[1]),
            }
        )
        trainer.learn(experience, step)
    prompt_ids, prompt_mask = left_pad(trainer.maker.next_prompts(), trainer.maker.pad_id)
    prompt = (prompt_ids, prompt_mask)
    torch.manual_seed(11)
    engine_ids = trainer.maker.generate(prompt).response_ids
    with torch.no_grad(), trainer.learner.whole_policy():  # the reference: generate on the gathered, updated policy
        torch.manual_seed(11)
        stops = trainer.maker.stop_ids
        reference_ids = generate_responses(policy, *prompt, config.ppo.rollout, stops, trainer.maker.pad_id)[0]
    policy.generate = counted(policy.generate)
    with torch.no_grad():  # the control: the partitioned policy, layer by layer, every rank in step
        control = policy.generate(
            input_ids=prompt_ids,
            attention_mask=prompt_mask,
            generation_config=sampling_config(config.ppo.rollout, trainer.maker.stop_ids, trainer.maker.pad_id),
            synced_gpus=True,
        )
    result = {
        "rank": context.rank,
        "world_size": context.world_size,
        "partitioned": all(hasattr(p, "ds_id") for p in policy.parameters()),
        "rollouts": rollouts,
        "control_all_gathers_during_generate": during_generate[-1],
        "control_generated_columns": int(control.shape[1] - prompt_ids.shape[1]),
        "same_tokens_as_generate_after_update": bool(torch.equal(engine_ids, reference_ids)),
    }
    print("ZERO3 " + json.dumps(result), flush=True)
    leave_process_group()  # as the stage worker does: exiting inside the group can abort a rank


if __name__ == "__main__":
    main()
