"""Typed configuration: `params.yaml` + overlays + `key.path=value` overrides -> one validated `Config`.

`params.yaml` is the single source of hyperparameters for every stage. It is validated here, at the
edge, before any work starts: an unknown key, a wrong type or an out-of-range value raises `ConfigError`
whose message names the key path, the bad value and what is allowed. Nothing else in the project reads
YAML or mutates a config: stages receive the frozen section they need.
"""

from __future__ import annotations

import copy
import hashlib
import json
import types
from collections.abc import Hashable
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator


class ConfigError(ValueError):
    """A configuration that cannot be used; the message lists every bad key path."""


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, values are frozen after validation."""

    model_config = ConfigDict(extra="forbid", frozen=True)


# --------------------------------------------------------------------------------------------------
# data


class DataConfig(Section):
    """Where the preference pairs come from, how they are validated and how they are split."""

    source: str = Field(
        "Anthropic/hh-rlhf",
        description="A local .jsonl/.jsonl.gz/.json/.parquet file, or a Hugging Face dataset id.",
    )
    hub_data_dir: str | None = Field("harmless-base", description="data_dir of a Hub dataset.")
    hub_split: str = Field("train", description="Split of a Hub dataset.")
    max_total_tokens: int = Field(512, gt=8, description="Drop pairs whose prompt+reply is longer.")
    max_prompt_tokens: int | None = Field(None, gt=0, description="Drop pairs whose prompt is longer.")
    max_drop_fraction: float = Field(0.5, ge=0.0, le=1.0, description="Fail when more rows are dropped.")
    split_salt: str = Field("rlhf-v1", min_length=1, description="Salt of the prompt-hash split.")
    eval_fraction: float = Field(0.1, gt=0.0, lt=1.0, description="Held-out evaluation prompts.")
    rm_val_fraction: float = Field(0.2, gt=0.0, lt=1.0, description="Reward-model validation prompts.")
    ppo_fraction: float = Field(0.25, gt=0.0, lt=1.0, description="PPO prompts (training and validation).")
    ppo_val_fraction: float = Field(
        0.05,
        ge=0.0,
        lt=1.0,
        description="The slice of the PPO prompts' hash range PPO validates on and never trains on (< ppo_fraction).",
    )
    max_eval_pairs: int | None = Field(None, gt=0)
    max_rm_train_pairs: int | None = Field(None, gt=0)
    max_rm_val_pairs: int | None = Field(None, gt=0)
    max_ppo_prompts: int | None = Field(None, gt=0)
    max_sft_examples: int | None = Field(None, gt=0)

    @model_validator(mode="after")
    def _fractions_leave_room_for_training(self) -> DataConfig:
        total = self.eval_fraction + self.rm_val_fraction + self.ppo_fraction
        if total >= 1.0:
            raise ValueError(
                f"eval_fraction + rm_val_fraction + ppo_fraction = {total:g} must be < 1 "
                "(the rest are the reward-model training prompts)"
            )
        if self.ppo_val_fraction >= self.ppo_fraction:
            raise ValueError(
                f"ppo_val_fraction {self.ppo_val_fraction:g} must be < ppo_fraction {self.ppo_fraction:g}: "
                "the validation prompts are a slice of the PPO prompts"
            )
        return self


# --------------------------------------------------------------------------------------------------
# model


class TinyModelConfig(Section):
    """A randomly initialised Llama model for tests; it keeps the real SmolLM2 tokenizer."""

    num_layers: int = Field(2, ge=1)
    hidden_size: int = Field(64, ge=8)
    num_heads: int = Field(4, ge=1)
    num_kv_heads: int = Field(2, ge=1)
    intermediate_size: int = Field(128, ge=8)
    seed: int = 0


class ModelConfig(Section):
    """The base chat model every stage starts from."""

    kind: Literal["smollm2", "tiny", "pretrained"] = Field(
        "smollm2",
        description="smollm2: the packaged SmolLM2-135M-Instruct GGUF; tiny: random (tests); "
        "pretrained: `path` is a local directory or a Hub id.",
    )
    path: str | None = Field(None, description="Directory or Hub id, with kind=pretrained.")
    cache_dir: str | None = Field(None, description="Conversion cache (default ~/.cache/rlhf-pipeline).")
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    tiny: TinyModelConfig = TinyModelConfig()

    @model_validator(mode="after")
    def _path_matches_kind(self) -> ModelConfig:
        if self.kind == "pretrained" and not self.path:
            raise ValueError("kind 'pretrained' needs model.path (a local directory or a Hub id)")
        return self


# --------------------------------------------------------------------------------------------------
# LoRA adapters (SFT, reward model, PPO policy and critic)

LLAMA_LINEAR_LAYERS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoraConfig(Section):
    """LoRA (Hu et al., 2021): train a low-rank update W + (alpha / r) * B A of chosen Linear layers.

    With `enabled`, every base weight is frozen and only the adapters (and a scalar head) train; with
    the stage's `trainable_top_layers: N` the adapters go into the top N blocks only. Saved models are
    always plain: the adapters are merged into the weights on export (rlhf_core/models/lora.py).
    """

    enabled: bool = False
    r: int = Field(8, ge=1, description="Rank of the update B A.")
    alpha: float = Field(16.0, gt=0, description="The update is scaled by alpha / r.")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapter's input while training.")
    target_modules: tuple[str, ...] = Field(
        LLAMA_LINEAR_LAYERS,
        min_length=1,
        description="Names of the Linear layers inside each transformer block that get adapters.",
    )

    @field_validator("target_modules")
    @classmethod
    def _distinct_layer_names(cls, names: tuple[str, ...]) -> tuple[str, ...]:
        if any(not name or "." in name for name in names):
            raise ValueError("expected plain layer names such as q_proj (no dots, not empty)")
        if len(set(names)) != len(names):
            raise ValueError("a layer name is listed twice")
        return names


# --------------------------------------------------------------------------------------------------
# training stages


class TrainingConfig(Section):
    """What the shared training loop needs; SFT and the reward model each have one."""

    epochs: float = Field(1.0, gt=0, description="Passes over the training data (fractions allowed).")
    max_steps: int | None = Field(None, gt=0, description="Caps the optimizer steps if set.")
    micro_batch_size: int = Field(4, ge=1)
    grad_accum_steps: int = Field(2, ge=1)
    lr: float = Field(2e-5, gt=0, lt=1)
    weight_decay: float = Field(0.0, ge=0)
    warmup_ratio: float = Field(0.1, ge=0, lt=1)
    max_grad_norm: float | None = Field(1.0, gt=0)
    max_length: int = Field(384, gt=8, description="Tokens per sequence; dialogues cut from the left.")
    trainable_top_layers: int | None = Field(
        None,
        ge=1,
        description="Train only the top N transformer blocks (+ final norm, heads); with lora.enabled, "
        "put the adapters into the top N blocks only.",
    )
    lora: LoraConfig = LoraConfig()
    gradient_checkpointing: bool = False
    eval_every: int = Field(50, ge=1, description="Optimizer steps between periodic validations.")
    eval_batches: int = Field(8, ge=1, description="Micro-batches in a periodic validation.")
    checkpoint_every: int = Field(25, ge=1)
    keep_checkpoints: int = Field(2, ge=1)


class SFTConfig(TrainingConfig):
    """Supervised fine-tuning on prompt + chosen reply, loss on the reply tokens only (paper 4.1)."""

    skip: bool = Field(False, description="Hand the base model on untrained (it is already a chat model).")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="Cosine decay ends at this share of lr.")


class RewardConfig(TrainingConfig):
    """Reward model: ranking loss + beta_rm * LM loss on the chosen reply (paper eq. 2, section 4.2)."""

    init_from: Literal["sft", "base"] = "sft"
    beta_rm: float = Field(1.0, ge=0, description="Weight of the LM loss term; 0 turns it off.")
    batching: Literal["fixed", "token_budget"] = "fixed"
    token_budget: int = Field(4096, gt=0, description="Padded tokens per micro-batch (token_budget).")
    cache_frozen_layers: bool = Field(
        True,
        description="With trainable_top_layers: compute the frozen lower blocks once per sequence and "
        "reuse them in later epochs and validations (memory: hidden_size floats per token).",
    )


# --------------------------------------------------------------------------------------------------
# PPO-max


# Each preset fills the PPO switches the user did not set (paper Figure 5 and section 5.4).
# docs/stages-ppo.md ("Departures") gives the source of each ppo_max value and where it departs.
PPO_PRESETS: dict[str, dict[str, Any]] = {
    "ppo_max": {
        "kl_coef": 0.01,
        "reward_normalization": True,
        "reward_clip": 5.0,
        "reward_scaling": False,
        "advantage_normalization": False,
        "advantage_clip": None,
        "clip_eps": 0.2,
        "value_clip": 0.2,
        "critic_init": "reward",
        "critic_pretrain_steps": 30,
        "gamma": 1.0,
        "lam": 0.95,
        "max_grad_norm": 1.0,
        "ptx_coef": 0.0,
        "entropy_coef": 0.0,
        "behaviour_logprobs": "rollout",
    },
    "vanilla": {
        "kl_coef": 0.0,
        "reward_normalization": False,
        "reward_clip": None,
        "reward_scaling": False,
        "advantage_normalization": False,
        "advantage_clip": None,
        "clip_eps": 0.2,
        "value_clip": None,
        "critic_init": "reward",
        "critic_pretrain_steps": 0,
        "gamma": 1.0,
        "lam": 0.95,
        "max_grad_norm": None,
        "ptx_coef": 0.0,
        "entropy_coef": 0.0,
        "behaviour_logprobs": "rollout",
    },
}


class GenerationConfig(Section):
    """Sampling settings. Rollouts default to pure temperature sampling so PPO stays on-policy."""

    max_new_tokens: int = Field(64, ge=1)
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    repetition_penalty: float = Field(1.0, gt=0)


class CollapseGuardConfig(Section):
    """Bounds that stop a collapsing run (paper 5.2); null disables a bound."""

    max_kl: float | None = Field(0.5, gt=0, description="Per-token KL to the reference.")
    max_length_drift: float | None = Field(
        2.0, gt=0, description="Allowed ratio of mean response length to the first step's (and inverse)."
    )
    max_perplexity_drop: float | None = Field(
        0.5, gt=0, lt=1, description="Largest allowed relative drop of response perplexity."
    )


class PPOConfig(Section):
    """PPO-max: every implementation detail of the paper's Figure 5 is a named switch.

    `preset` fills every switch left unset; a switch set explicitly always wins.
    """

    preset: Literal["ppo_max", "vanilla"] = "ppo_max"
    kl_coef: float = Field(ge=0, description="Token-level KL penalty eta (k1 in the reward).")
    reward_normalization: bool = Field(description="Normalise scores by running mean/std (5.3.1).")
    reward_clip: float | None = Field(gt=0, description="Clip normalised scores to +-delta.")
    reward_scaling: bool = Field(description="Divide scores by their running std only (alternative).")
    advantage_normalization: bool = Field(description="Whiten advantages over the rollout batch.")
    advantage_clip: float | None = Field(gt=0, description="Clip advantages to +-bound.")
    clip_eps: float = Field(gt=0, lt=1, description="Clipped-surrogate epsilon.")
    value_clip: float | None = Field(gt=0, description="Value-loss clipping range; null is off.")
    critic_init: Literal["reward", "sft"] = Field(description="Critic from the RM, or SFT + new head.")
    critic_pretrain_steps: int = Field(
        ge=0, description="At most this many critic-only iterations before the policy moves (0: none)."
    )
    critic_pretrain_patience: int = Field(
        3, ge=1, description="End critic pretraining after this many iterations without a lower value loss."
    )
    critic_pretrain_min_improvement: float = Field(
        0.02, ge=0, lt=1, description="A value loss counts as lower when it beats the best by this share."
    )
    gamma: float = Field(ge=0, le=1)
    lam: float = Field(ge=0, le=1)
    max_grad_norm: float | None = Field(gt=0, description="Global gradient clipping; null is off.")
    ptx_coef: float = Field(ge=0, description="PPO-ptx (Figure 12's variant): weight of the SFT-data LM loss; 0 is off.")
    entropy_coef: float = Field(ge=0)
    behaviour_logprobs: Literal["rollout", "reference"] = Field(
        description="Importance-sampling reference: the rollout policy, or the reference model (5.3.2)."
    )
    steps: int = Field(40, ge=1, description="PPO iterations (rollout + update).")
    rollout_batch_size: int = Field(8, ge=1, description="Prompts per rollout (the experience buffer).")
    mini_batch_size: int = Field(4, ge=1)
    micro_batch_size: int = Field(4, ge=1)
    ppo_epochs: int = Field(1, ge=1)
    policy_lr: float = Field(1e-6, gt=0, lt=1)
    critic_lr: float = Field(5e-6, gt=0, lt=1)
    unfinished_penalty: float = Field(
        -1.0, description="Added to the score of a response cut without an end-of-turn token."
    )
    max_prompt_tokens: int = Field(256, gt=0)
    trainable_top_layers: int | None = Field(None, ge=1)
    lora: LoraConfig = Field(LoraConfig(), description="Adapters for the policy and the critic alike.")
    frozen_models_dtype: Literal["float32", "bfloat16"] | None = Field(
        None, description="dtype of the frozen reference and reward models; null: model.dtype."
    )
    share_frozen_trunk: bool = Field(
        True,
        description="Run the frozen lower blocks the four models share once per rollout (rlhf_core.ppo.shared_trunk).",
    )
    rollout: GenerationConfig = GenerationConfig()
    guard: CollapseGuardConfig = CollapseGuardConfig()
    eval_every: int = Field(10, ge=1, description="Validate every this many PPO iterations (and after the last).")
    val_prompts: int | None = Field(
        None, ge=2, description="Validate on the first this many ppo_val_prompts; null: all of them."
    )
    checkpoint_every: int = Field(10, ge=1)
    keep_checkpoints: int = Field(2, ge=1)
    sample_table_every: int = Field(10, ge=1)

    @model_validator(mode="before")
    @classmethod
    def _fill_from_preset(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        preset = data.get("preset", "ppo_max")
        if preset not in PPO_PRESETS:
            return data  # the Literal check on `preset` reports it
        return {**PPO_PRESETS[preset], **data}

    @model_validator(mode="after")
    def _batches_divide(self) -> PPOConfig:
        if self.rollout_batch_size % self.mini_batch_size:
            raise ValueError("rollout_batch_size must be a multiple of mini_batch_size")
        if self.mini_batch_size % self.micro_batch_size:
            raise ValueError("mini_batch_size must be a multiple of micro_batch_size")
        return self


# --------------------------------------------------------------------------------------------------
# evaluation, tracking, distributed


class EvaluationConfig(Section):
    """Held-out comparison of two models (paper section 6)."""

    judge: Literal["rm", "llm", "human"] = "rm"
    max_prompts: int | None = Field(
        None, ge=1, description="Evaluate on the eval split's first prompts by id; null: every eval prompt."
    )
    generation: GenerationConfig = GenerationConfig(
        max_new_tokens=128, temperature=0.8, top_p=0.9, repetition_penalty=1.1
    )
    tie_margin: float = Field(0.0, ge=0, description="RM judge: a score margin under this is a tie.")
    judge_rm: Literal["in_sample", "independent"] = Field(
        "independent",
        description="RM judge: independent trains a second reward model on the PPO-prompt split to judge "
        "with; in_sample judges with the reward model PPO optimised against (biased; the report flags it).",
    )
    llm_model: str = "gpt-4o"
    llm_concurrency: int = Field(4, ge=1)
    llm_max_retries: int = Field(3, ge=0)

    @property
    def trains_judge_rm(self) -> bool:
        """Whether the pipeline trains the independent judge reward model: asked for, and an rm judge.

        The human judge falls back to the reward model inside the pipeline (tasks/evaluation.py), so
        only the LLM judge leaves the judge reward model unused.
        """
        return self.judge_rm == "independent" and self.judge != "llm"


class TrackingConfig(Section):
    """MLflow tracking and registry names."""

    tracking_uri: str | None = Field(None, description="Default: SQLite + local artifacts in mlruns/.")
    experiment: str = "rlhf-pipeline"
    policy_model_name: str = "rlhf-policy"
    reward_model_name: str = "rlhf-reward"


class PromotionConfig(Section):
    """The gate a `challenger` policy must pass to become the `champion` (the rlhf-promote flow)."""

    min_win_minus_loss_low: float = Field(
        0.0,
        ge=-1,
        lt=1,
        description="The lower end of the 95% bootstrap interval of win minus loss must exceed this.",
    )
    max_kl: float | None = Field(
        0.3, gt=0, description="Bound on the PPO policy's per-token KL to the reference (val/kl_best); null: none."
    )
    require_no_collapse: bool = Field(True, description="Refuse a policy whose PPO run the collapse guard stopped.")
    judge_reward_model: str | None = Field(
        None,
        description="The judging reward model: a reward-model directory or models:/ URI; null: the "
        "independent judge registered with the challenger; in_sample: the challenger's own (biased, flagged).",
    )


class DistributedConfig(Section):
    """Scale-out with DeepSpeed ZeRO; one process by default (rlhf_core/distributed, infra/deepspeed/).

    With `num_processes > 1` the SFT, reward-model and PPO stages run under the `deepspeed` launcher,
    `num_processes` ranks on each of `num_nodes` machines; the batch sizes of each stage are per rank.
    """

    num_processes: int = Field(1, ge=1, description="Processes (GPUs) per node; 1 runs in-process.")
    num_nodes: int = Field(1, ge=1, description="Machines; more than 1 needs `hostfile`.")
    hostfile: str | None = Field(None, description="DeepSpeed hostfile: one `host slots=N` line per node.")
    master_addr: str | None = Field(None, description="Rank 0's address; null: 127.0.0.1 or the first host.")
    master_port: int = Field(29500, ge=1024, le=65535, description="Rank 0's rendezvous port.")
    zero_stage: Literal[0, 1, 2, 3] = 2
    offload_optimizer: bool = Field(False, description="Keep optimizer states in CPU memory (ZeRO 2/3).")
    bf16: bool = Field(False, description="bf16 autocast on CUDA; CPU always trains in fp32.")
    config_template: str | None = Field(
        None, description="A DeepSpeed JSON template; null: infra/deepspeed/zero2.json or zero3.json."
    )

    @model_validator(mode="after")
    def _launch_is_possible(self) -> DistributedConfig:
        if self.num_nodes > 1 and not self.hostfile:
            raise ValueError("num_nodes > 1 needs a hostfile naming the nodes (see infra/deepspeed/README.md)")
        if self.offload_optimizer and self.zero_stage < 2:
            raise ValueError("offload_optimizer needs zero_stage 2 or 3")
        return self

    @property
    def world_size(self) -> int:
        """Ranks in all: processes per node times nodes."""
        return self.num_processes * self.num_nodes


# --------------------------------------------------------------------------------------------------
# the whole config


class Config(Section):
    """Every hyperparameter of the pipeline, as resolved from params.yaml + overlays + overrides."""

    seed: int = 42
    data: DataConfig = DataConfig()
    model: ModelConfig = ModelConfig()
    sft: SFTConfig = SFTConfig()
    reward: RewardConfig = RewardConfig()
    ppo: PPOConfig = PPOConfig()
    evaluation: EvaluationConfig = EvaluationConfig()
    tracking: TrackingConfig = TrackingConfig()
    promotion: PromotionConfig = PromotionConfig()
    distributed: DistributedConfig = DistributedConfig()

    def section_hash(self, name: str) -> str:
        """A short content hash of one section (cache keys, lineage tags)."""
        payload = json.dumps(getattr(self, name).model_dump(mode="json"), sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:16]


# --------------------------------------------------------------------------------------------------
# loading


def deep_merge(base: dict[str, Any], overlay: dict[str, Any]) -> dict[str, Any]:
    """Merge `overlay` into a copy of `base`: mappings merge key by key, anything else replaces."""
    merged = copy.deepcopy(base)
    for key, value in overlay.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def parse_override(text: str) -> dict[str, Any]:
    """Turn `a.b.c=value` into `{"a": {"b": {"c": value}}}`; the value is parsed as YAML."""
    key_path, sep, raw = text.partition("=")
    keys = key_path.strip().split(".")
    if not sep or not all(keys):
        raise ConfigError(f"override {text!r}: expected key.path=value, e.g. ppo.kl_coef=0.02")
    try:
        value = _load_yaml(raw, f"override {text!r}") if raw.strip() else None
    except yaml.YAMLError as err:
        raise ConfigError(f"override {text!r}: the value is not valid YAML ({err})") from err
    nested: dict[str, Any] = {keys[-1]: value}
    for key in reversed(keys[:-1]):
        nested = {key: nested}
    return nested


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping.

    Plain PyYAML keeps the last of two equal keys, so a section written twice in an overlay silently
    loses its first half. `<<` merge keys are not duplicates: keys given beside them override them.
    """

    source = "<string>"

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if not isinstance(key, Hashable):
                continue  # PyYAML itself reports an unhashable key
            if key in seen:
                raise ConfigError(
                    f"{self.source}: line {line}: duplicate key {key!r} (first given on line {seen[key]}); "
                    "YAML would keep only the last one: merge the two into one entry"
                )
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def _load_yaml(text: str, source: str) -> Any:
    """`yaml.safe_load` that refuses duplicate keys; `source` names the file in the error."""
    loader = _UniqueKeyLoader(text)
    loader.source = source
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def read_yaml_mapping(path: Path) -> dict[str, Any]:
    """Read a YAML file that must hold a mapping (an empty file is an empty mapping)."""
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = _load_yaml(path.read_text(encoding="utf-8"), str(path)) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML ({err})") from err
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, got {type(data).__name__}")
    return data


def _describe_error(error: dict[str, Any], model: type[BaseModel]) -> str:
    """One line per pydantic error: key path, bad value, what is allowed."""
    location = ".".join(str(part) for part in error["loc"]) or "(top level)"
    if error["type"] == "extra_forbidden":
        allowed = ", ".join(sorted(_fields_at(model, error["loc"][:-1])))
        return f"{location}: unknown key; allowed keys here: {allowed}"
    message = error["msg"].removeprefix("Value error, ")
    if error["type"] == "missing":
        return f"{location}: required"
    return f"{location}: {message} (got {error['input']!r})"


def _fields_at(model: type[BaseModel], location: tuple[Any, ...]) -> list[str]:
    """The field names of the (nested) section at `location`."""
    for part in location:
        field = model.model_fields.get(str(part))
        annotation = field.annotation if field else None
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return []
        model = annotation
    return list(model.model_fields)


def _scalar_types(annotation: Any) -> set[Any]:
    """The scalar types a field annotation admits: `int | None` -> {int, NoneType}, Literal[0, 1] -> {int}."""
    origin = get_origin(annotation)
    if origin is Literal:
        return {type(value) for value in get_args(annotation)}
    if origin in (Union, types.UnionType):
        return set().union(*(_scalar_types(argument) for argument in get_args(annotation)))
    return {annotation} if isinstance(annotation, type) else set()


def _bool_number_mixups(raw: Any, model: type[BaseModel], location: tuple[str, ...] = ()) -> dict[tuple[str, ...], str]:
    """Key paths where a boolean stands for a number or a number for a boolean, each with its message.

    pydantic's lax mode reads `true` as 1 for an integer field and 1 as true for a boolean one, so
    `-s sft.max_steps=true` would quietly train one step. Booleans and numbers are kept apart here;
    other coercions (the string "1e-4" for a float) stay allowed.
    """
    if not isinstance(raw, dict):
        return {}
    found: dict[tuple[str, ...], str] = {}
    for key, value in raw.items():
        field = model.model_fields.get(str(key))
        if field is None:
            continue  # pydantic reports unknown keys
        path = (*location, str(key))
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            found |= _bool_number_mixups(value, field.annotation, path)
            continue
        admitted = _scalar_types(field.annotation)
        numbers = admitted & {int, float}
        if isinstance(value, bool) and numbers and bool not in admitted:
            kind = "an integer" if numbers == {int} else "a number"
            off = " (null turns it off)" if type(None) in admitted else ""
            found[path] = f"{'.'.join(path)}: expected {kind}{off}, got the boolean {str(value).lower()}"
        elif bool in admitted and not numbers and value is not None and not isinstance(value, bool):
            found[path] = f"{'.'.join(path)}: expected true or false, got {value!r}"
    return found


def validate_config(raw: dict[str, Any]) -> Config:
    """Validate a merged mapping; every problem is reported at once, by key path."""
    mixups = _bool_number_mixups(raw, Config)
    try:
        config = Config.model_validate(raw)
    except ValidationError as err:
        lines = [
            _describe_error(e, Config) for e in err.errors() if tuple(map(str, e["loc"])) not in mixups
        ]
        raise ConfigError("invalid configuration: " + "; ".join([*mixups.values(), *lines])) from None
    if mixups:
        raise ConfigError("invalid configuration: " + "; ".join(mixups.values()))
    return config


def load_config(
    params_file: Path | str = "params.yaml",
    overlays: list[Path | str] | tuple[Path | str, ...] = (),
    overrides: list[str] | tuple[str, ...] = (),
) -> Config:
    """Resolve the configuration: params.yaml, then each overlay file, then each override."""
    raw = read_yaml_mapping(Path(params_file))
    for overlay in overlays:
        raw = deep_merge(raw, read_yaml_mapping(Path(overlay)))
    for override in overrides:
        raw = deep_merge(raw, parse_override(override))
    return validate_config(raw)
