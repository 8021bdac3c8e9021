"""`evaluation:` the held-out comparison of two models (docs/evaluation.md)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from rlhf_core.config.base import Section
from rlhf_core.config.generation import RolloutConfig
from rlhf_core.config.model import ModelConfig


class EvaluationConfig(Section):
    """Held-out comparison of two models (paper section 6)."""

    judge: Literal["rm", "llm", "human"] = Field(
        "rm", description="Who compares the replies: a reward model, an LLM (docs/evaluation.md) or people."
    )
    max_prompts: int | None = Field(
        None, ge=1, description="Evaluate on the eval split's first prompts by id; null: every eval prompt."
    )
    generation: RolloutConfig = Field(
        RolloutConfig(max_new_tokens=128, temperature=0.8, top_p=0.9, repetition_penalty=1.1),
        description="Sampling for the compared replies (the paper's evaluation settings) and the engine that "
        "samples them (lean by default, as PPO's rollouts).",
    )
    batch_size: int = Field(
        8,
        ge=1,
        description="Replies sampled together: a larger batch shares each decode step's weight traffic among more "
        "replies (benchmarks/eval_generation.py measures it); it decides which replies are drawn, so a stored "
        "model is sampled again after a change.",
    )
    length_matched_samples: int = Field(
        4,
        ge=1,
        description="Replies per prompt and model the length-matched pairs are drawn from, the main reply "
        "included (docs/evaluation.md); each one above 1 adds the main replies' generation time again.",
    )
    length_controlled_samples: int | None = Field(
        None,
        ge=1,
        description="Pairs per prompt the length-controlled win rate is fitted on: A's i-th reply against B's "
        "i-th, for i below this, bootstrapped over prompts (docs/evaluation.md); null: every reply drawn "
        "(length_matched_samples); 1: the main pair alone, as AlpacaEval. Each pair above 1 is judged too.",
    )
    min_anchor_pairs: int = Field(
        30,
        ge=1,
        description="Anchor pairs (model B's replies to a prompt against each other, judged too) whose length "
        "difference reaches the compared pairs' median |dlen| that the length-controlled win rate needs; with "
        "fewer it is reported not identifiable, and the promotion gate fails it (docs/evaluation.md).",
    )
    min_informative_pairs: float = Field(
        60,
        ge=0,
        description="Compared pairs not decided by length alone (sum of 4 p (1 - p), p the judge's preference the "
        "anchor-measured length terms predict) the length-controlled win rate needs; with fewer it is reported "
        "not identifiable: the judge's length preference leaves no room to see a gain beyond it.",
    )
    tie_margin: float = Field(0.0, ge=0, description="RM judge: a score margin under this is a tie.")
    judge_rm: Literal["in_sample", "independent"] = Field(
        "independent",
        description="RM judge: independent trains a second reward model on the PPO-prompt split to judge "
        "with; in_sample judges with the reward model PPO optimised against (biased; the report flags it).",
    )
    judge_base_model: ModelConfig | None = Field(
        None,
        description="RM judge, independent: the base model the judge reward model starts from, a whole `model` "
        "section (e.g. {kind: gemma3}, another model family); null: the policy's base model `model`.",
    )
    llm_model: str = Field("gpt-4o", description="LLM judge: the OpenAI-compatible model name.")
    llm_concurrency: int = Field(4, ge=1, description="LLM judge: requests in flight.")
    llm_max_retries: int = Field(3, ge=0, description="LLM judge: retries of a failed request.")

    @model_validator(mode="after")
    def _length_controlled_pairs_come_from_the_drawn_replies(self) -> EvaluationConfig:
        wanted = self.length_controlled_samples
        if wanted is not None and wanted > self.length_matched_samples:
            raise ValueError(
                f"evaluation.length_controlled_samples ({self.length_controlled_samples}) pairs the replies drawn "
                f"per prompt and model, evaluation.length_matched_samples ({self.length_matched_samples}): "
                "set it to at most that, or raise evaluation.length_matched_samples"
            )
        return self

    @model_validator(mode="after")
    def _judge_base_model_needs_an_independent_judge(self) -> EvaluationConfig:
        if self.judge_base_model is not None and self.judge_rm == "in_sample":
            raise ValueError(
                "evaluation.judge_base_model is set, but evaluation.judge_rm is 'in_sample', which trains no judge "
                "reward model; set evaluation.judge_rm: independent or evaluation.judge_base_model: null"
            )
        return self

    @property
    def pairs_per_prompt(self) -> int:
        """The pairs per prompt the length-controlled win rate is fitted on (`length_controlled_samples`)."""
        wanted = self.length_controlled_samples
        return self.length_matched_samples if wanted is None else wanted

    @property
    def trains_judge_rm(self) -> bool:
        """Whether the pipeline trains the independent judge reward model: asked for, and an rm judge.

        The human judge falls back to the reward model inside the pipeline (tasks/evaluation/evaluate_task.py), so
        only the LLM judge leaves the judge reward model unused.
        """
        return self.judge_rm == "independent" and self.judge != "llm"
