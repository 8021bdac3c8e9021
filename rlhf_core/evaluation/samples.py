"""A few replies of a model to held-out prompts, for people to read beside its figures.

The SFT stage's task publishes them as a table (tasks/stages/stage_tasks.py), the way the PPO stage publishes its
rollout samples: the first `count` evaluation prompts (ordered by prompt id, as the evaluation orders
them), each with the held-out reference reply and the model's reply, sampled with the evaluation's
settings (`evaluation.generation`) from `seed`, so two runs of the same model show the same replies.
"""

from __future__ import annotations

from pathlib import Path

from rlhf_core.config import RolloutConfig
from rlhf_core.evaluation.generation import generate_replies
from rlhf_core.evaluation.prompts import evaluation_prompts
from rlhf_core.models.loading import load_causal_lm

SAMPLE_BATCH_SIZE = 4


def sample_generations(
    model_dir: Path, data_dir: Path, settings: RolloutConfig, seed: int, count: int
) -> list[dict[str, object]]:
    """One row per prompt: the prompt's last message, the reference reply, the model's reply, its length and
    whether it ended (False: cut at `settings.max_new_tokens`). No rows when the eval split is empty (the
    evaluation stage says so; a table of samples is no reason to fail the stage showing it)."""
    try:
        prompts = evaluation_prompts(data_dir, count)
    except ValueError:
        return []
    model, tokenizer = load_causal_lm(model_dir)
    replies = generate_replies(
        model, tokenizer, [prompt.prompt for prompt in prompts], settings, SAMPLE_BATCH_SIZE, seed
    )
    return [
        {
            "prompt": prompt.prompt[-1]["content"],
            "reference": prompt.reference_reply,
            "response": reply.text,
            "length": reply.tokens,
            "finished": reply.finished,
        }
        for prompt, reply in zip(prompts, replies)
    ]
