"""Hash-based splits: disjoint prompts, stable when data grows, caps by lowest hash, SFT and PPO derivation."""

from __future__ import annotations

import hashlib
import random
from dataclasses import replace

import pytest

from rlhf_core.data.records import PreferencePair
from rlhf_core.data.splits import Split, SplitConfig, assign_split, prompt_bucket, split_pairs

CONFIG = SplitConfig(eval_fraction=0.1, rm_val_fraction=0.1, ppo_fraction=0.3, salt="test-salt")


def make_pairs(prompts: range, pairs_per_prompt: int = 2) -> list[PreferencePair]:
    """Pairs whose prompts differ by number; odd prompts get a re-cased, re-spaced copy of the question."""
    pairs = []
    for number in prompts:
        for copy in range(pairs_per_prompt):
            question = f"Question  {number}?" if copy % 2 else f"question {number}?"
            pairs.append(
                PreferencePair(
                    prompt=({"role": "user", "content": question},),
                    chosen=f"good answer {number}.{copy}",
                    rejected=f"bad answer {number}.{copy}",
                    source="synthetic.jsonl",
                    line=number * pairs_per_prompt + copy + 1,
                )
            )
    return pairs


def reference_split(prompt_id: str, config: SplitConfig) -> str:
    """Straightforward reference: sha256(salt + newline + prompt_id), first 8 bytes as a fraction."""
    value = int(hashlib.sha256(f"{config.salt}\n{prompt_id}".encode()).hexdigest()[:16], 16) / 2**64
    if value < config.eval_fraction:
        return "eval"
    if value < config.eval_fraction + config.rm_val_fraction:
        return "rm_val"
    if value < config.eval_fraction + config.rm_val_fraction + config.ppo_fraction:
        return "ppo"
    return "rm_train"


def prompt_ids(pairs) -> set[str]:
    return {pair.prompt_id for pair in pairs}


def test_assignment_matches_reference_and_fractions_are_roughly_respected() -> None:
    pairs = make_pairs(range(2000), pairs_per_prompt=1)
    counts = {split: 0 for split in ("eval", "rm_val", "ppo", "rm_train")}
    for pair in pairs:
        split = assign_split(pair.prompt_id, CONFIG)
        assert split.value == reference_split(pair.prompt_id, CONFIG)
        assert 0.0 <= prompt_bucket(pair.prompt_id, CONFIG.salt) < 1.0
        counts[split.value] += 1
    # 2000 prompts: binomial standard deviation is at most ~22, so +-100 cannot fail by chance.
    assert abs(counts["eval"] - 200) < 100
    assert abs(counts["rm_val"] - 200) < 100
    assert abs(counts["ppo"] - 600) < 100
    assert abs(counts["rm_train"] - 1000) < 100


def test_no_prompt_in_two_splits_and_normalised_copies_stay_together() -> None:
    pairs = make_pairs(range(300))
    splits = split_pairs(pairs, CONFIG)
    groups = [
        prompt_ids(splits.rm_train),
        prompt_ids(splits.rm_val),
        prompt_ids(splits.eval),
        {prompt.prompt_id for prompt in splits.ppo_prompts},
    ]
    for first in range(len(groups)):
        for second in range(first + 1, len(groups)):
            assert not groups[first] & groups[second]
    assert all(groups)
    # Every pair of a prompt (including its re-cased copy) went to the same place: nothing is lost.
    assert sum(len(group) for group in groups) == 300
    assert len(splits.rm_train) + len(splits.rm_val) + len(splits.eval) == 2 * (300 - len(groups[3]))


def test_adding_data_keeps_every_prompt_in_its_split_regardless_of_order() -> None:
    before = split_pairs(make_pairs(range(200)), CONFIG)
    grown = make_pairs(range(500))
    random.Random(0).shuffle(grown)
    after = split_pairs(grown, CONFIG)

    def split_of(splits) -> dict[str, str]:
        mapping = {pair.prompt_id: name for name in ("rm_train", "rm_val", "eval") for pair in getattr(splits, name)}
        mapping.update({prompt.prompt_id: "ppo" for prompt in splits.ppo_prompts})
        return mapping

    old, new = split_of(before), split_of(after)
    assert len(old) == 200
    assert all(new[prompt_id] == split for prompt_id, split in old.items())


def test_caps_keep_lowest_hash_pairs_independent_of_order_and_never_move_the_rest() -> None:
    caps = {"max_eval_pairs": 7, "max_rm_val_pairs": 5, "max_rm_train_pairs": 40, "max_ppo_prompts": 9}
    capped = replace(CONFIG, **caps, max_sft_examples=30)
    pairs = make_pairs(range(400))
    uncapped = split_pairs(pairs, CONFIG)
    shuffled = list(pairs)
    random.Random(1).shuffle(shuffled)
    first, second = split_pairs(pairs, capped), split_pairs(shuffled, capped)

    def rank(pair: PreferencePair) -> tuple[float, str]:
        return prompt_bucket(pair.prompt_id, "test-salt"), pair.pair_id

    for name, cap in (("eval", 7), ("rm_val", 5), ("rm_train", 40)):
        expected = {pair.pair_id for pair in sorted(getattr(uncapped, name), key=rank)[:cap]}
        assert {pair.pair_id for pair in getattr(first, name)} == expected, name
        assert {pair.pair_id for pair in getattr(second, name)} == expected, name
        assert first.held_back_by_caps[name] == len(getattr(uncapped, name)) - cap
    by_bucket = sorted(uncapped.ppo_prompts, key=lambda prompt: prompt_bucket(prompt.prompt_id, "test-salt"))
    expected_ppo = {prompt.prompt_id for prompt in by_bucket[:9]}
    # Kept prompts stay in input order.
    assert [p.prompt_id for p in first.ppo_prompts] == [
        p.prompt_id for p in uncapped.ppo_prompts if p.prompt_id in expected_ppo
    ]
    assert {p.prompt_id for p in second.ppo_prompts} == expected_ppo
    assert len(first.sft) == 30
    assert {(e.prompt_id, e.response) for e in first.sft} == {(e.prompt_id, e.response) for e in second.sft}
    # Pairs a cap left out appear in no other split.
    for name in ("eval", "rm_val", "rm_train"):
        others = [other for other in ("eval", "rm_val", "rm_train") if other != name]
        left_out = {pair.pair_id for pair in getattr(uncapped, name)} - {pair.pair_id for pair in getattr(first, name)}
        assert left_out
        for other in others:
            assert not left_out & {pair.pair_id for pair in getattr(first, other)}


def test_caps_keep_earlier_choices_when_data_grows_within_the_cap_range() -> None:
    """A kept eval pair stays kept after growth unless a new pair with a lower hash displaces it."""
    capped = SplitConfig(eval_fraction=0.1, rm_val_fraction=0.1, ppo_fraction=0.3, salt="s", max_eval_pairs=20)
    small, large = split_pairs(make_pairs(range(300)), capped), split_pairs(make_pairs(range(360)), capped)
    large_ids = {pair.pair_id for pair in large.eval}

    def rank(pair: PreferencePair) -> tuple[float, str]:
        return prompt_bucket(pair.prompt_id, "s"), pair.pair_id

    threshold = max(rank(pair) for pair in large.eval)
    assert any(pair.pair_id in large_ids for pair in small.eval)
    for pair in small.eval:
        assert (pair.pair_id in large_ids) == (rank(pair) <= threshold)


def test_sft_examples_come_from_rm_train_only_one_per_prompt_and_reply() -> None:
    pairs = make_pairs(range(200))
    duplicate_chosen = PreferencePair(pairs[0].prompt, pairs[0].chosen, "another bad answer", "synthetic.jsonl", 999)
    splits = split_pairs([*pairs, duplicate_chosen], CONFIG)
    expected = {(pair.prompt_id, pair.chosen) for pair in splits.rm_train}
    got = [(example.prompt_id, example.response) for example in splits.sft]
    assert len(got) == len(set(got))
    assert set(got) == expected
    assert prompt_ids(splits.rm_train) >= {example.prompt_id for example in splits.sft}


def test_ppo_prompts_are_distinct_and_disjoint_from_eval_rm_val_and_rm_train() -> None:
    splits = split_pairs(make_pairs(range(300)), CONFIG)
    ppo = [prompt.prompt_id for prompt in splits.ppo_prompts]
    assert len(ppo) == len(set(ppo)) > 0
    assert not set(ppo) & (prompt_ids(splits.eval) | prompt_ids(splits.rm_val) | prompt_ids(splits.rm_train))
    assert all(assign_split(prompt_id, CONFIG) is Split.PPO for prompt_id in ppo)


def test_ppo_validation_prompts_are_the_first_hash_slice_of_the_ppo_bucket_and_never_trained_on() -> None:
    config = SplitConfig(
        eval_fraction=0.1, rm_val_fraction=0.1, ppo_fraction=0.3, ppo_val_fraction=0.1, salt="test-salt"
    )
    pairs = make_pairs(range(400))
    splits = split_pairs(pairs, config)
    validation = [prompt.prompt_id for prompt in splits.ppo_val_prompts]
    training = {prompt.prompt_id for prompt in splits.ppo_prompts}
    assert len(validation) == len(set(validation)) > 20
    assert not set(validation) & training
    assert not set(validation) & (prompt_ids(splits.eval) | prompt_ids(splits.rm_val) | prompt_ids(splits.rm_train))
    for prompt_id in validation:  # reference: the bucket lies in [eval + rm_val, eval + rm_val + ppo_val)
        bucket = int(hashlib.sha256(f"test-salt\n{prompt_id}".encode()).hexdigest()[:16], 16) / 2**64
        assert 0.2 <= bucket < 0.3
    assert prompt_ids(splits.ppo_pairs) == set(validation) | training  # the judge RM sees the whole bucket
    grown = split_pairs(make_pairs(range(600)), config)  # more data moves no validation prompt
    assert set(validation) <= {prompt.prompt_id for prompt in grown.ppo_val_prompts}


def test_a_ppo_validation_slice_as_large_as_the_ppo_bucket_is_rejected() -> None:
    with pytest.raises(ValueError, match="ppo_val_fraction"):
        SplitConfig(eval_fraction=0.1, rm_val_fraction=0.1, ppo_fraction=0.2, ppo_val_fraction=0.2, salt="s")


def test_a_different_salt_gives_a_different_split() -> None:
    pairs = make_pairs(range(200), pairs_per_prompt=1)
    other = SplitConfig(eval_fraction=0.1, rm_val_fraction=0.1, ppo_fraction=0.3, salt="other-salt")
    assert [assign_split(p.prompt_id, CONFIG) for p in pairs] != [assign_split(p.prompt_id, other) for p in pairs]


@pytest.mark.parametrize(
    ("fractions", "message"),
    [((0.5, 0.3, 0.2), "must be < 1"), ((0.6, 0.3, 0.4), "must be < 1"), ((-0.1, 0.1, 0.1), "eval_fraction")],
)
def test_bad_fractions_are_rejected_with_a_clear_message(fractions: tuple[float, float, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SplitConfig(*fractions, salt="s")
