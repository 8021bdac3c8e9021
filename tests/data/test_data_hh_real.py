"""The data stage on 1,800 real HH-RLHF harmless-base pairs (shared/data, beside the repository)."""

from __future__ import annotations

from pathlib import Path

import pytest

from fixtures.pairs import word_lengths
from fixtures.paths import SHARED_PAIRS
from rlhf_core.config import DataConfig
from rlhf_core.data.prepare import load_split, prepare_preference_data


@pytest.mark.skipif(not SHARED_PAIRS.is_file(), reason=f"shared real data not found at {SHARED_PAIRS}")
def test_real_hh_pairs_are_mostly_kept_and_split_without_shared_prompts(tmp_path: Path) -> None:
    settings = DataConfig(eval_fraction=0.05, rm_val_fraction=0.05, ppo_fraction=0.2, max_total_tokens=2048)
    out_dir = tmp_path / "prepared"
    report = prepare_preference_data([SHARED_PAIRS], out_dir, settings, word_lengths)

    assert report.rows_read == 1800
    assert report.formats == {"hh_transcript": 1800}
    assert report.pairs_kept >= 1750
    dropped = {reason: summary for reason, summary in report.drops.items() if summary.count}
    assert report.pairs_kept + sum(summary.count for summary in dropped.values()) == 1800
    # Known quirks of this file: a few empty final replies and a few non-alternating transcripts.
    assert dropped["empty_reply"].count >= 1 and dropped["malformed_turns"].count >= 1
    for summary in dropped.values():
        assert summary.examples and all(example.source == SHARED_PAIRS.name for example in summary.examples)

    splits = {name: load_split(out_dir, name) for name in ("rm_train", "rm_val", "eval")}
    ppo = load_split(out_dir, "ppo_prompts")
    prompt_sets = [{pair.prompt_id for pair in pairs} for pairs in splits.values()] + [{p.prompt_id for p in ppo}]
    assert sum(len(ids) for ids in prompt_sets) == len(set().union(*prompt_sets))
    assert all(prompt_sets)
    assert {example.prompt_id for example in load_split(out_dir, "sft")} <= prompt_sets[0]
    assert all(pair.prompt[-1]["role"] == "user" and pair.chosen and pair.rejected for pair in splits["rm_train"])
    assert 0 < report.token_lengths["prompt"].p50 <= report.token_lengths["prompt"].p95
