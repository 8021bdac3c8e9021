"""The evaluation's store of models' replies (rlhf_core/evaluation/model_replies.py): an evaluation that
meets a model it sampled before reads its replies, which are the ones sampling would give, and anything
that decides the replies changes the key."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import PreTrainedTokenizerBase

import rlhf_core.stages.evaluate as evaluate_stage
from fixtures.tiny_ppo import StageInputs, tiny_config
from rlhf_core.evaluation.generation import Reply
from rlhf_core.evaluation.model_replies import ModelReplies, ReplyStore, replies_key
from rlhf_core.evaluation.prompts import evaluation_prompts
from rlhf_core.models.saving import save_causal_lm
from rlhf_core.models.tiny import build_tiny_model
from rlhf_core.stages.evaluate import run_evaluate
from rlhf_core.stages.result import write_metrics

pytestmark = pytest.mark.usefixtures("one_thread")

EVAL_FILES = ("generations.jsonl", "generations_matched.jsonl", "generations_samples.jsonl", "verdicts.jsonl")


def test_store_round_trip_and_unreadable_entries(tmp_path: Path) -> None:
    store = ReplyStore(tmp_path / "replies")
    replies = ModelReplies(
        main=[Reply("hello", 2, True), Reply("cut", 64, False)],
        extra=[[Reply("again", 1, True)], [Reply("", 0, True)]],
        perplexity=12.5,
        measured=2,
    )
    assert store.load("k") is None
    store.save("k", replies)
    assert store.load("k") == replies
    store.path("k").write_text('{"main": [')  # a torn file is a miss, replaced by the next save
    assert store.load("k") is None


def test_everything_that_decides_the_replies_is_in_the_key(inputs: StageInputs) -> None:
    config = tiny_config()
    prompts = evaluation_prompts(inputs.data_dir, config.evaluation.max_prompts)
    cpu = torch.device("cpu")
    key = replies_key("model-sha", prompts, config, cpu)
    assert key == replies_key("model-sha", prompts, tiny_config(), cpu)
    others = [
        replies_key("other-sha", prompts, config, cpu),
        replies_key("model-sha", prompts[1:], config, cpu),
        replies_key("model-sha", prompts, tiny_config("seed=7"), cpu),
        replies_key("model-sha", prompts, tiny_config("evaluation.generation.temperature=0.5"), cpu),
        replies_key("model-sha", prompts, tiny_config("evaluation.length_matched_samples=3"), cpu),
        replies_key("model-sha", prompts, tiny_config("sft.max_length=64"), cpu),
        replies_key("model-sha", prompts, tiny_config("evaluation.batch_size=4"), cpu),
        replies_key("model-sha", prompts, config, torch.device("meta")),
    ]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        others.append(replies_key("model-sha", prompts, config, cpu))
    finally:
        torch.set_num_threads(threads)
    assert len({key, *others}) == 1 + len(others)


def test_an_evaluation_reads_a_model_it_sampled_before(
    inputs: StageInputs, tokenizer: PreTrainedTokenizerBase, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two policies against one SFT model: the second evaluation samples only its new policy, and its
    files are byte for byte those of an evaluation without the store."""
    policies = []
    for seed in (1, 2):
        policy = tmp_path / f"policy{seed}"
        save_causal_lm(build_tiny_model(tokenizer, seed=seed), tokenizer, policy / "model")
        write_metrics(policy, {"steps": 0.0})
        policies.append(policy)
    sampled: list[Path] = []
    sample = evaluate_stage.sample_model_replies

    def counted(config, model_dir, *args):  # type: ignore[no-untyped-def]
        sampled.append(Path(model_dir))
        return sample(config, model_dir, *args)

    monkeypatch.setattr(evaluate_stage, "sample_model_replies", counted)
    config = tiny_config()
    store = tmp_path / "replies"

    def evaluate(policy: Path, out: str, replies_dir: Path | None) -> dict[str, float]:
        return run_evaluate(
            config,
            inputs.data_dir,
            policy,
            inputs.sft_dir,
            tmp_path / out,
            rm_dir=inputs.rm_dir,
            replies_dir=replies_dir,
        ).metrics

    evaluate(policies[0], "first", store)
    assert [path.parent.name for path in sampled] == ["policy1", inputs.sft_dir.name]
    sampled.clear()
    stored = evaluate(policies[1], "second", store)
    assert [path.parent.name for path in sampled] == ["policy2"]  # the SFT model's replies came from the store
    fresh = evaluate(policies[1], "fresh", None)
    for name in EVAL_FILES:
        assert (tmp_path / "second" / name).read_bytes() == (tmp_path / "fresh" / name).read_bytes()
    assert stored["alignment_tax"] == fresh["alignment_tax"]
    assert len(list(store.iterdir())) == 3  # one entry per model
