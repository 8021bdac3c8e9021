"""The independent judge reward model (`evaluation.judge_rm: independent`).

- rlhf_core: `run_judge_rm` trains on the PPO-prompt split's pairs, from the base model, and its
  training_data.json names the file it read (checked against the file's bytes): not one of its prompts
  is a prompt the policy reward model (rm_train), SFT, validation or evaluation saw.
- config: `independent` is the default (and every eval prompt is judged); a bad `evaluation.judge_rm` is
  an error naming the key and the allowed values.
- `evaluation.judge_base_model`: null keeps the policy's base model; set, the judge trains from
  that model (here a tiny model of another shape), and it, not the policy's, makes the judge-reward
  stage's cache key; a bad value or an in-sample judge with it is an error naming the key.
- the pipeline, in this process against a real Prefect server and a SQLite MLflow store: with
  `independent` the judge-reward stage runs, the evaluation is judged by it, is not flagged in-sample
  and says what the judge was trained on, and registration registers the judge as its own model, with
  its lineage and training data as tags, and tags the policy with that judge version; with `in_sample`
  the judge-reward stage does not run and the evaluation is flagged in-sample.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from mlflow import MlflowClient

from fixtures.pairs import write_topic_pairs
from fixtures.paths import PARAMS, TINY
from fixtures.tiny_ppo import tiny_config, write_stage_inputs
from flows.pipeline import PipelineSettings, Stage, rlhf_pipeline
from rlhf_core.config import ConfigError, ModelConfig, load_config
from rlhf_core.data.prepare import load_split
from rlhf_core.models.heads import RewardModel
from rlhf_core.reward.training_data import read_training_data
from rlhf_core.stages.judge_reward import judge_config, run_judge_rm
from rlhf_core.stages.reward import run_train_rm
from tasks.execution.caching import stage_cache_key
from tasks.registry.registered_models import (
    CONTENT_TAG,
    JUDGE_MODEL_TAG,
    JUDGE_VERSION_TAG,
    LINEAGE_OUTPUT_PREFIX,
    PIPELINE_RUN_TAG,
    STAGE_RUN_TAG,
)
from tasks.stages.stage_runs import STAGE_SECTIONS
from tasks.tracking.lineage import DATA_VERSION_TAG

pytestmark = pytest.mark.usefixtures("one_thread")


INDEPENDENT = (
    "independent reward model (trained on the PPO-prompt split, validated on rm_val, initialised from the base model)"
)
# At the tiny overlay's policy_lr one iteration hands on its start, which is not evaluated (test_identical_evaluation)
PIPELINE_OVERRIDES = ["ppo.steps=2", "ppo.policy_lr=2e-4", "evaluation.max_prompts=4"]
# A judge base model unlike the policy's tiny model (2 layers, 64 wide, seed 0).
OTHER_JUDGE_MODEL = (
    "evaluation.judge_base_model={kind: tiny, tiny: {num_layers: 3, hidden_size: 32, num_heads: 2, "
    "num_kv_heads: 1, intermediate_size: 48, seed: 7}}"
)


def file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def prompt_ids(data_dir: Path, split: str) -> set[str]:
    return {item.prompt_id for item in load_split(data_dir, split)}  # type: ignore[arg-type]


def test_the_judge_trains_on_pairs_disjoint_from_the_policy_reward_model(tmp_path: Path) -> None:
    inputs = write_stage_inputs(tmp_path, pairs=120)
    config = tiny_config()
    policy = run_train_rm(config, inputs.data_dir, inputs.sft_dir, tmp_path / "reward")
    judge = run_judge_rm(config, inputs.data_dir, tmp_path / "judge")

    policy_record, judge_record = read_training_data(tmp_path / "reward"), read_training_data(tmp_path / "judge")
    assert policy_record is not None and judge_record is not None
    assert (policy_record.train_split, policy_record.init_from) == ("rm_train", "sft")
    assert (judge_record.train_split, judge_record.init_from) == ("ppo_pairs", "base")
    assert policy_record.validation_split == judge_record.validation_split == "rm_val"
    assert policy_record.train_file_sha256 == file_sha256(inputs.data_dir / "rm_train.parquet")
    assert judge_record.train_file_sha256 == file_sha256(inputs.data_dir / "ppo_pairs.parquet")

    judge_prompts = prompt_ids(inputs.data_dir, "ppo_pairs")
    assert judge_prompts and judge.metrics["train_pairs"] == len(load_split(inputs.data_dir, "ppo_pairs"))
    assert policy.metrics["train_pairs"] == len(load_split(inputs.data_dir, "rm_train"))
    for other in ("rm_train", "sft", "rm_val", "eval"):
        assert judge_prompts.isdisjoint(prompt_ids(inputs.data_dir, other)), other
    # The whole PPO bucket: the prompts PPO trains on and its validation slice (no cap bites at this size).
    ppo_bucket = prompt_ids(inputs.data_dir, "ppo_prompts") | prompt_ids(inputs.data_dir, "ppo_val_prompts")
    assert judge_prompts == ppo_bucket
    history_params = json.loads((tmp_path / "judge" / "history.params.json").read_text())
    assert (history_params["train_split"], history_params["reward"]["init_from"]) == ("ppo_pairs", "base")
    assert judge.model_dir == tmp_path / "judge" / "model"


def test_judge_rm_defaults_to_independent_and_accepts_only_in_sample_or_independent() -> None:
    defaults = load_config(PARAMS).evaluation
    assert (defaults.judge, defaults.judge_rm, defaults.max_prompts) == ("rm", "independent", None)
    assert defaults.trains_judge_rm and tiny_config().evaluation.judge_rm == "independent"
    assert tiny_config("evaluation.judge_rm=independent").evaluation.trains_judge_rm
    assert not tiny_config("evaluation.judge_rm=independent", "evaluation.judge=llm").evaluation.trains_judge_rm
    with pytest.raises(ConfigError) as error:
        tiny_config("evaluation.judge_rm=held_out")
    assert "evaluation.judge_rm: Input should be 'in_sample' or 'independent' (got 'held_out')" in str(error.value)


def test_the_judge_trains_from_evaluation_judge_base_model_when_set(tmp_path: Path) -> None:
    inputs = write_stage_inputs(tmp_path, pairs=120)
    config = tiny_config(OTHER_JUDGE_MODEL)
    run_judge_rm(config, inputs.data_dir, tmp_path / "judge")

    judge = RewardModel.from_pretrained(tmp_path / "judge" / "model")
    shape = judge.backbone.config
    assert (shape.num_hidden_layers, shape.hidden_size, shape.num_attention_heads) == (3, 32, 2)
    assert (shape.num_key_value_heads, shape.intermediate_size) == (1, 48)
    assert config.model.tiny.num_layers == 2 and config.model.tiny.hidden_size == 64  # the policy's, unlike it


def test_judge_config_takes_the_judge_base_model_or_else_the_policys() -> None:
    policy_only = tiny_config()
    assert policy_only.evaluation.judge_base_model is None
    assert judge_config(policy_only).model == policy_only.model
    assert judge_config(policy_only).reward.init_from == "base"

    other = tiny_config(OTHER_JUDGE_MODEL)
    assert judge_config(other).model == other.evaluation.judge_base_model
    assert judge_config(other).model.tiny.seed == 7 and other.model.tiny.seed == 0
    assert judge_config(other).ppo == other.ppo and judge_config(other).evaluation == other.evaluation


def test_the_judge_base_model_makes_the_judge_reward_cache_key() -> None:
    def judge_key(config) -> str:
        return stage_cache_key("judge-reward", judge_config(config), STAGE_SECTIONS["judge-reward"], {})

    policy_only = tiny_config()
    assert judge_key(tiny_config(OTHER_JUDGE_MODEL)) != judge_key(policy_only)
    # The policy's own model written out as the judge's is the same judge.
    same = tiny_config(f"evaluation.judge_base_model={json.dumps(policy_only.model.model_dump(mode='json'))}")
    assert judge_key(same) == judge_key(policy_only)


def test_judge_base_model_is_validated_with_the_key_named() -> None:
    assert load_config(PARAMS).evaluation.judge_base_model is None
    gemma = tiny_config("evaluation.judge_base_model.kind=gemma3").evaluation.judge_base_model
    assert gemma == ModelConfig(kind="gemma3")
    with pytest.raises(ConfigError) as error:
        tiny_config("evaluation.judge_base_model.kind=gpt")
    assert "evaluation.judge_base_model.kind: Input should be 'smollm2', 'gemma3', 'tiny' or 'pretrained'" in str(
        error.value
    )
    with pytest.raises(ConfigError) as error:
        tiny_config("evaluation.judge_base_model.kind=pretrained")
    assert "kind 'pretrained' needs model.path" in str(error.value)
    with pytest.raises(ConfigError) as error:
        tiny_config("evaluation.judge_base_model.size=270m")
    allowed = "allowed keys here: cache_dir, dtype, kind, path, tiny"
    assert f"evaluation.judge_base_model.size: unknown key; {allowed}" in str(error.value)
    with pytest.raises(ConfigError) as error:
        tiny_config("evaluation.judge_base_model.tiny.num_layers=true")
    assert "evaluation.judge_base_model.tiny.num_layers: expected an integer, got the boolean true" in str(error.value)
    with pytest.raises(ConfigError) as error:
        tiny_config("evaluation.judge_base_model.kind=gemma3", "evaluation.judge_rm=in_sample")
    assert "evaluation.judge_base_model is set, but evaluation.judge_rm is 'in_sample'" in str(error.value)


def test_the_judge_refuses_a_multi_process_configuration(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"distributed.num_processes \* num_nodes = 2"):
        run_judge_rm(tiny_config("distributed.num_processes=2"), tmp_path / "data", tmp_path / "judge")


def pipeline_settings(data: Path, judge_rm: str, stages: list[Stage]) -> PipelineSettings:
    return PipelineSettings(
        config=[str(TINY)],
        overrides=[*PIPELINE_OVERRIDES, f"evaluation.judge_rm={judge_rm}"],
        data=str(data),
        stages=stages,
        params_file=str(PARAMS),
    )


@pytest.mark.slow
def test_the_pipeline_judges_with_the_independent_reward_model_only_when_asked(
    mlflow_store: MlflowClient, tmp_path: Path
) -> None:
    data = write_topic_pairs(tmp_path / "pairs.jsonl", 160)
    independent = rlhf_pipeline(pipeline_settings(data, "independent", [Stage.REGISTER]))

    judge_output = independent.outputs["judge-reward"]
    assert judge_output.out_dir == independent.run_dir / "judge_reward"
    assert read_training_data(judge_output.out_dir).train_split == "ppo_pairs"  # type: ignore[union-attr]
    report = json.loads((independent.outputs["evaluate"].out_dir / "report.json").read_text())
    assert report["judge"]["in_sample"] is False
    assert report["judge"]["name"] == f"reward model {judge_output.out_dir}"
    assert INDEPENDENT in report["judge"]["description"]
    report_md = (independent.outputs["evaluate"].out_dir / "report.md").read_text()
    assert INDEPENDENT in report_md and "In-sample judge" not in report_md
    assert "**Judge:** the independent judge reward model: " in report_md
    assert ", judged by the independent judge reward model\n" in independent.summary()
    assert independent.outputs["evaluate"].metrics["judge_in_sample"] == 0.0
    (policy,) = [version for version in independent.registered if version.name == "rlhf-policy"]
    tags = mlflow_store.get_model_version("rlhf-policy", policy.version).tags
    assert tags["evaluation.judge_in_sample"] == "false"
    assert tags["evaluation.judge_description"] == report["judge"]["description"]
    assert tags[f"{LINEAGE_OUTPUT_PREFIX}judge-reward.out_dir"] == str(judge_output.out_dir)
    (judge,) = [version for version in independent.registered if version.name == "rlhf-reward-judge"]
    assert (tags[JUDGE_MODEL_TAG], tags[JUDGE_VERSION_TAG]) == ("rlhf-reward-judge", judge.version)
    judge_tags = mlflow_store.get_model_version("rlhf-reward-judge", judge.version).tags
    data_dir = independent.outputs["prepare-data"].out_dir
    assert {key: judge_tags[key] for key in judge_tags if key.startswith("training_data.")} == {
        "training_data.train_split": "ppo_pairs",
        "training_data.train_file_sha256": file_sha256(data_dir / "ppo_pairs.parquet"),
        "training_data.validation_split": "rm_val",
        "training_data.init_from": "base",
    }
    assert judge_tags[CONTENT_TAG] == judge_output.sha256
    assert judge_tags[STAGE_RUN_TAG] == judge_output.mlflow_run_id
    assert judge_tags[PIPELINE_RUN_TAG] == independent.mlflow_run_id
    assert judge_tags[DATA_VERSION_TAG] == independent.data.version == tags[DATA_VERSION_TAG]
    assert f"registered: rlhf-reward-judge version {judge.version}" in independent.summary()
    metrics = independent.outputs["evaluate"].metrics
    assert metrics["score_diff_low"] <= metrics["score_diff_mean"] <= metrics["score_diff_high"]
    assert tags["evaluation.score_diff_mean"] == f"{metrics['score_diff_mean']:.6g}"

    in_sample = rlhf_pipeline(pipeline_settings(data, "in_sample", [Stage.EVALUATE]))
    assert set(in_sample.outputs) == {"prepare-data", "sft", "reward", "ppo", "evaluate"}
    assert in_sample.outputs["ppo"] == independent.outputs["ppo"]  # a cache hit: the judge changes no stage before
    report = json.loads((in_sample.outputs["evaluate"].out_dir / "report.json").read_text())
    assert report["judge"]["in_sample"] is True
    assert report["judge"]["name"] == f"reward model {in_sample.outputs['reward'].out_dir}"
    assert ", judged by the in-sample reward model (IN-SAMPLE" in in_sample.summary()
