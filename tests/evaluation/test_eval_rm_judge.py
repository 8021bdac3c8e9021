"""The reward-model judge on a tiny reward model with a hand-set head: scores, margins, ties, loading."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlhf_core.evaluation.judges.reward_model import RewardModelJudge, margin_verdict, score_replies
from rlhf_core.evaluation.judges.verdicts import EvalPair, Verdict
from rlhf_core.models.chat import encode_conversation, end_of_turn_id
from rlhf_core.models.heads import RewardModel
from rlhf_core.models.tiny import build_tiny_model
from rlhf_core.stages.result import write_metrics

BIAS = 0.5


@pytest.fixture(scope="module")
def reward_model(tokenizer) -> RewardModel:
    """A tiny reward model whose score is the first feature of the final hidden state plus 0.5."""
    model = RewardModel.from_causal_lm(build_tiny_model(tokenizer, seed=4), end_of_turn_id(tokenizer))
    with torch.no_grad():
        model.score_head.weight.zero_()
        model.score_head.weight[0, 0] = 1.0
        model.score_head.bias.fill_(BIAS)
    return model.eval()


def make_pairs() -> list[EvalPair]:
    questions = ["How do I boil an egg?", "Is the sea salty?", "Name a colour.", "What is 2 + 2?", "Hello!"]
    replies = [
        ("Put it in boiling water for eight minutes.", "No."),
        ("Yes.", "Yes, the sea is salty because of dissolved minerals."),
        ("Blue.", "Blue."),
        ("Four.", "It is four, since two and two make four."),
        ("", "Hi there, how can I help?"),
    ]
    return [
        EvalPair(f"p{i}", ({"role": "user", "content": question},), a, b, "test")
        for i, (question, (a, b)) in enumerate(zip(questions, replies))
    ]


def reference_score(model: RewardModel, tokenizer, prompt, reply: str) -> float:
    """Straightforward reference: one unpadded sequence, feature 0 of the last token's hidden state + bias."""
    ids = encode_conversation(tokenizer, prompt, reply).input_ids
    assert ids[-1] == end_of_turn_id(tokenizer)
    with torch.no_grad():
        hidden = model.backbone(input_ids=torch.tensor([ids])).last_hidden_state
    return float(hidden[0, -1, 0]) + BIAS


def test_scores_match_the_reference_despite_batching_and_padding(reward_model, tokenizer) -> None:
    pairs = make_pairs()
    conversations = [(pair.prompt, reply) for pair in pairs for reply in (pair.reply_a, pair.reply_b)]
    scores = score_replies(reward_model, tokenizer, conversations, batch_size=3)
    expected = [reference_score(reward_model, tokenizer, prompt, reply) for prompt, reply in conversations]
    assert scores.tolist() == pytest.approx(expected, abs=1e-4)


def test_batches_are_cut_from_the_conversations_sorted_by_length(reward_model, tokenizer) -> None:
    pairs = make_pairs()
    conversations = [(pair.prompt, reply) for pair in pairs for reply in (pair.reply_a, pair.reply_b)]
    lengths = sorted(len(encode_conversation(tokenizer, prompt, reply).input_ids) for prompt, reply in conversations)
    widths: list[tuple[int, int]] = []
    hook = reward_model.register_forward_pre_hook(lambda module, args: widths.append(tuple(args[0].shape)))
    try:
        score_replies(reward_model, tokenizer, conversations, batch_size=3)
    finally:
        hook.remove()
    assert widths == [(len(lengths[i : i + 3]), max(lengths[i : i + 3])) for i in range(0, len(lengths), 3)]


def test_verdicts_follow_the_margins_and_the_tie_margin(reward_model, tokenizer) -> None:
    pairs = make_pairs()
    margins = [
        reference_score(reward_model, tokenizer, p.prompt, p.reply_a)
        - reference_score(reward_model, tokenizer, p.prompt, p.reply_b)
        for p in pairs
    ]
    # A tie margin between the smallest and the largest non-zero |margin| makes some pairs ties.
    nonzero = sorted(abs(m) for m in margins if abs(m) > 1e-6)
    tie_margin = (nonzero[0] + nonzero[-1]) / 2
    expected = [Verdict.TIE if abs(m) <= tie_margin else (Verdict.A if m > 0 else Verdict.B) for m in margins]
    assert Verdict.TIE in expected and set(expected) - {Verdict.TIE}

    judge = RewardModelJudge(reward_model, tokenizer, tie_margin, batch_size=4, source="tiny", in_sample=False)
    judgements = judge.judge(pairs)
    assert [j.verdict for j in judgements] == expected
    assert [j.detail["margin"] for j in judgements] == pytest.approx(margins, abs=1e-4)
    assert judgements[2].verdict is Verdict.TIE  # identical replies


def test_swapping_the_models_swaps_the_verdicts(reward_model, tokenizer) -> None:
    pairs = make_pairs()
    swapped = [EvalPair(p.prompt_id, p.prompt, p.reply_b, p.reply_a, p.category) for p in pairs]
    judge = RewardModelJudge(reward_model, tokenizer, 0.0, batch_size=2, source="tiny", in_sample=False)
    flip = {Verdict.A: Verdict.B, Verdict.B: Verdict.A, Verdict.TIE: Verdict.TIE}
    assert [j.verdict for j in judge.judge(swapped)] == [flip[j.verdict] for j in judge.judge(pairs)]


def test_a_constant_head_ties_everything(tokenizer) -> None:
    model = RewardModel.from_causal_lm(build_tiny_model(tokenizer, seed=5), end_of_turn_id(tokenizer))
    with torch.no_grad():
        model.score_head.weight.zero_()
        model.score_head.bias.fill_(3.0)
    judge = RewardModelJudge(model.eval(), tokenizer, 0.0, batch_size=4, source="tiny", in_sample=True)
    assert {j.verdict for j in judge.judge(make_pairs())} == {Verdict.TIE}


def test_margin_verdict() -> None:
    assert margin_verdict(0.3, 0.2) is Verdict.A
    assert margin_verdict(-0.3, 0.2) is Verdict.B
    assert margin_verdict(0.2, 0.2) is Verdict.TIE
    assert margin_verdict(0.0, 0.0) is Verdict.TIE
    assert margin_verdict(1e-9, 0.0) is Verdict.A


def test_loads_from_a_completed_stage_output_and_says_when_in_sample(reward_model, tokenizer, tmp_path: Path) -> None:
    stage_dir = tmp_path / "reward"
    reward_model.save_pretrained(stage_dir / "model", tokenizer)
    with pytest.raises(FileNotFoundError, match="unfinished stage output"):
        RewardModelJudge.from_directory(stage_dir, 0.0, batch_size=4, in_sample=True)
    write_metrics(stage_dir, {"steps": 1.0})

    judge = RewardModelJudge.from_directory(stage_dir, 0.0, batch_size=4, in_sample=True)
    in_memory = RewardModelJudge(reward_model, tokenizer, 0.0, batch_size=4, source="tiny", in_sample=True)
    assert [j.verdict for j in judge.judge(make_pairs())] == [j.verdict for j in in_memory.judge(make_pairs())]
    info = judge.info()
    assert info.kind == "rm" and info.in_sample and "IN-SAMPLE" in info.description
    assert str(stage_dir) in info.name
    assert info.figures["pairs_judged"] == len(make_pairs())
    independent = RewardModelJudge.from_directory(stage_dir / "model", 0.0, batch_size=4, in_sample=False).info()
    assert not independent.in_sample and "independent" in independent.description
