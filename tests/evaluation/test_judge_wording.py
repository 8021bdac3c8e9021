"""Who judged, worded once: the run summary's `evaluation:` line and report.md name the
same judge in the same words (`JudgeInfo.role`): the independent judge reward model, the in-sample
reward model, another reward model, an LLM or people."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlhf_core.config import RolloutConfig
from rlhf_core.evaluation.judges.reward_model import reward_model_role
from rlhf_core.evaluation.judges.verdicts import JudgeInfo, Verdict
from rlhf_core.evaluation.report import JudgedPair, build_report
from rlhf_core.evaluation.report_markdown import render_markdown
from rlhf_core.reward.training_data import RewardTrainingData
from rlhf_core.stage_outputs import StageOutput
from rlhf_core.stages.evaluate import REPORT_JSON
from tasks.evaluation.evaluate_task import evaluation_summary

GENERATION = RolloutConfig(max_new_tokens=6, temperature=0.8, top_p=0.9, repetition_penalty=1.1)


def trained_on(split: str) -> RewardTrainingData:
    return RewardTrainingData(
        train_split=split, train_file_sha256="0" * 64, validation_split="rm_val", init_from="base"
    )


def test_a_reward_model_judge_is_named_by_what_it_was_trained_on() -> None:
    assert reward_model_role(False, trained_on("ppo_pairs")) == "the independent judge reward model"
    assert reward_model_role(True, trained_on("rm_train")).startswith("the in-sample reward model (IN-SAMPLE")
    other = "a reward model other than the one PPO optimised against"
    assert reward_model_role(False, trained_on("rm_train")) == other  # e.g. another run's reward model
    assert reward_model_role(False, None) == other  # a bare model directory says nothing of its data


@pytest.mark.parametrize(
    "judge",
    [
        JudgeInfo("rm", "reward model j", reward_model_role(False, trained_on("ppo_pairs")), "reward model j (...)"),
        JudgeInfo("rm", "reward model r", reward_model_role(True, None), "reward model r (...)", in_sample=True),
        JudgeInfo("llm", "LLM gpt-4o", "the LLM judge gpt-4o", "LLM judge gpt-4o at http://x (...)"),
        JudgeInfo("human", "human", "people (human evaluation)", "people, in the Prefect UI (...)"),
    ],
    ids=["independent", "in-sample", "llm", "human"],
)
def test_the_summary_names_the_judge_as_report_md_does(judge: JudgeInfo, tmp_path: Path) -> None:
    pairs = [JudgedPair(f"k{i}", "helpful", 10 + i, 10, Verdict.A if i % 3 else Verdict.B) for i in range(6)]
    report = build_report(pairs, judge, "PPO policy", "SFT model", GENERATION, seed=0, resamples=50)
    (tmp_path / REPORT_JSON).write_text(report.model_dump_json(), encoding="utf-8")
    output = StageOutput(stage="evaluate", out_dir=tmp_path, sha256="0" * 64)

    headline = evaluation_summary(output)[0]
    assert headline == f"evaluation: PPO policy (A) vs SFT model (B), judged by {judge.role}"
    assert f"**Judge:** {judge.role}: {judge.description}." in render_markdown(report)
    assert ("In-sample judge" in render_markdown(report)) == judge.in_sample
    if judge.kind == "rm" and not judge.in_sample:
        assert "in-sample" not in headline.lower()
