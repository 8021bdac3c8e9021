"""The human-evaluation flow's own generation (when it starts from two models and prepared data instead of
an `rlhf eval` generations file): the replies are exactly what `rlhf eval` samples, and a session that
already has its pairs keeps them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from fixtures.paths import PARAMS, TINY
from rlhf_core.config import load_config
from rlhf_core.evaluation.generation import generate_replies
from rlhf_core.evaluation.judges.human import MATCHED_PAIRS_FILE, PAIRS_FILE, open_session
from rlhf_core.evaluation.outputs import read_generations
from rlhf_core.evaluation.prompts import evaluation_prompts
from rlhf_core.models.loading import load_causal_lm
from rlhf_core.models.saving import save_causal_lm
from rlhf_core.models.tiny import build_tiny_model, load_tiny_model
from rlhf_core.stages.prepare_data import run_prepare_data
from rlhf_core.stages.result import write_metrics
from tasks.evaluation.human_eval import generate_pairs_task


def hh_row(index: int) -> str:
    prompt = f"\n\nHuman: Tell me about gardening number {index}."
    return json.dumps(
        {"chosen": f"{prompt}\n\nAssistant: Gardening {index} is fine.", "rejected": f"{prompt}\n\nAssistant: No."}
    )


def test_generated_pairs_match_rlhf_eval_sampling_and_are_kept_on_resume(tmp_path: Path) -> None:
    raw = tmp_path / "raw.jsonl"
    raw.write_text("".join(hh_row(index) + "\n" for index in range(40)))
    config = load_config(
        PARAMS,
        overlays=[TINY],
        overrides=["data.eval_fraction=0.3", "evaluation.max_prompts=4", "evaluation.generation.max_new_tokens=5"],
    )
    run_prepare_data(config, tmp_path / "data", source=str(raw))
    tokenizer = load_tiny_model()[1]
    for name, seed in (("ppo", 0), ("sft", 1)):
        save_causal_lm(build_tiny_model(tokenizer, seed=seed), tokenizer, tmp_path / name / "model")
        write_metrics(tmp_path / name, {"steps": 0.0})

    out_dir = tmp_path / "human"
    path = generate_pairs_task.fn(config, tmp_path / "data", str(tmp_path / "ppo"), str(tmp_path / "sft"), out_dir)
    assert path == out_dir / PAIRS_FILE
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    prompts = evaluation_prompts(tmp_path / "data", 4)
    assert [row["prompt_id"] for row in rows] == [prompt.prompt_id for prompt in prompts]
    for name, column in (("ppo", "reply_a"), ("sft", "reply_b")):
        model, model_tokenizer = load_causal_lm(tmp_path / name / "model")
        reference = generate_replies(
            model,
            model_tokenizer,
            [p.prompt for p in prompts],
            config.evaluation.generation,
            config.evaluation.batch_size,
            config.seed,
        )
        assert [row[column] for row in rows] == [reply.text for reply in reference]
    matched = [json.loads(line) for line in (out_dir / MATCHED_PAIRS_FILE).read_text().splitlines()]
    for row in matched:  # the closest-length pair of the prompt's replies, within 20% of the longer
        assert abs(row["tokens_a"] - row["tokens_b"]) <= 0.2 * max(row["tokens_a"], row["tokens_b"])
        assert row["sample_a"] in (0, 1) and row["sample_b"] in (0, 1)  # tiny.yaml: 2 replies per model
    main_keys = {item.pair.pair_key for item in read_generations(path)}
    extra = [item for item in read_generations(out_dir / MATCHED_PAIRS_FILE) if item.pair.pair_key not in main_keys]
    session = open_session(out_dir, path, seed=0, matched=out_dir / MATCHED_PAIRS_FILE)
    assert len(session.plan.pairs) == 4 + len(extra)

    before = path.read_bytes()
    shutil.rmtree(tmp_path / "ppo")  # a resumed session does not sample again
    assert (
        generate_pairs_task.fn(config, tmp_path / "data", str(tmp_path / "ppo"), str(tmp_path / "sft"), out_dir) == path
    )
    assert path.read_bytes() == before


def test_missing_models_fail_before_any_work(tmp_path: Path) -> None:
    config = load_config(PARAMS, overlays=[TINY])
    with pytest.raises(FileNotFoundError, match="neither a stage output directory"):
        generate_pairs_task.fn(
            config, tmp_path / "data", str(tmp_path / "nope"), str(tmp_path / "sft"), tmp_path / "out"
        )
