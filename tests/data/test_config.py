"""Configuration: params.yaml, overlays and overrides resolve; every class of bad value names its key."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from fixtures.paths import PARAMS, ROOT, TINY
from rlhf_core.config import PPO_PRESETS, ConfigError, load_config, parse_override


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "overlay.yaml"
    path.write_text(text)
    return path


def test_shipped_files_resolve() -> None:
    base = load_config(PARAMS)
    assert base.model.kind == "smollm2"
    tiny = load_config(PARAMS, overlays=[TINY])
    assert tiny.model.kind == "tiny" and tiny.sft.max_steps == 4
    paper = load_config(PARAMS, overlays=[ROOT / "configs" / "paper-7b.yaml"])
    assert paper.ppo.policy_lr == 5e-7 and paper.ppo.critic_lr == 1.65e-6
    assert paper.distributed.zero_stage == 3


def test_overlay_merges_and_override_wins(tmp_path: Path) -> None:
    overlay = write(tmp_path, "sft:\n  lr: 0.001\n")
    config = load_config(PARAMS, overlays=[overlay], overrides=["sft.lr=0.5", "reward.beta_rm=0"])
    assert config.sft.lr == 0.5
    assert config.reward.beta_rm == 0
    assert config.sft.micro_batch_size == 4  # untouched keys keep params.yaml's value


def test_override_values_are_parsed_as_yaml() -> None:
    assert parse_override("ppo.value_clip=null") == {"ppo": {"value_clip": None}}
    assert parse_override("a.b=[1, 2]") == {"a": {"b": [1, 2]}}
    assert parse_override("sft.skip=true") == {"sft": {"skip": True}}


@pytest.mark.parametrize("bad", ["no-equals-sign", "=3", "a..b=1"])
def test_malformed_override_is_rejected(bad: str) -> None:
    with pytest.raises(ConfigError, match="key.path=value"):
        parse_override(bad)


def test_unknown_key_names_the_path_and_the_allowed_keys() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(PARAMS, overrides=["ppo.rollout.temprature=0.7"])
    message = str(err.value)
    assert "ppo.rollout.temprature: unknown key" in message
    assert "temperature" in message  # the allowed keys are listed


def test_unknown_top_level_section() -> None:
    with pytest.raises(ConfigError, match="trainer: unknown key; allowed keys here: data, distributed"):
        load_config(PARAMS, overrides=["trainer.lr=1"])


def test_wrong_type_names_key_and_value() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(PARAMS, overrides=["sft.micro_batch_size=four"])
    assert "sft.micro_batch_size" in str(err.value) and "'four'" in str(err.value)


def test_out_of_range_names_key_and_bound() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(PARAMS, overrides=["ppo.clip_eps=1.5"])
    assert "ppo.clip_eps: Input should be less than 1 (got 1.5)" in str(err.value)


@pytest.mark.parametrize("batching", ["length_grouped", "token_budget"])
def test_odin_with_length_sorted_batches_is_refused_naming_both_keys(batching: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(PARAMS, overrides=["reward.length_debias=odin", f"reward.batching={batching}"])
    assert "reward" in str(err.value) and f"length_debias odin needs batching fixed, not {batching}" in str(err.value)
    assert "set reward.batching: fixed" in str(err.value)
    assert load_config(PARAMS, overrides=["reward.length_debias=odin"]).reward.batching == "fixed"


def test_length_controlled_pairs_are_at_most_the_replies_drawn() -> None:
    assert load_config(PARAMS).evaluation.pairs_per_prompt == 4  # null: every drawn reply
    one = load_config(PARAMS, overrides=["evaluation.length_matched_samples=1"]).evaluation
    assert one.pairs_per_prompt == 1
    assert load_config(PARAMS, overrides=["evaluation.length_controlled_samples=2"]).evaluation.pairs_per_prompt == 2
    with pytest.raises(ConfigError) as err:
        load_config(PARAMS, overrides=["evaluation.length_controlled_samples=5"])
    assert "evaluation.length_controlled_samples (5)" in str(err.value)
    assert "evaluation.length_matched_samples (4)" in str(err.value)


def test_bad_choice_lists_the_allowed_values() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(PARAMS, overrides=["model.kind=gpt"])
    assert "model.kind" in str(err.value) and "'smollm2', 'gemma3', 'tiny' or 'pretrained'" in str(err.value)


def test_cross_field_rule_is_reported() -> None:
    with pytest.raises(ConfigError, match="eval_fraction \\+ rm_val_fraction \\+ ppo_fraction"):
        load_config(PARAMS, overrides=["data.eval_fraction=0.5", "data.rm_val_fraction=0.5"])
    with pytest.raises(ConfigError, match="model.path"):
        load_config(PARAMS, overrides=["model.kind=pretrained"])


def test_all_errors_reported_at_once() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(PARAMS, overrides=["sft.lr=-1", "reward.epochs=0"])
    assert "sft.lr" in str(err.value) and "reward.epochs" in str(err.value)


def test_missing_and_malformed_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(write(tmp_path, "- a\n- b\n"))


def test_a_directory_given_as_a_config_file_is_called_a_directory() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(PARAMS, overlays=[ROOT / "configs"])
    message = str(err.value)
    assert "configs is a directory, not a config file" in message and "not found" not in message
    assert f"{ROOT / 'configs' / 'tiny.yaml'}" in message  # the YAML files there, to pick one from


@pytest.mark.parametrize("value", [".nan", ".inf", "-.inf"])
def test_a_non_finite_number_is_refused_as_such(value: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(PARAMS, overrides=[f"sft.lr={value}", f"ppo.clip_eps={value}", f"evaluation.tie_margin={value}"])
    for key in ("sft.lr", "ppo.clip_eps", "evaluation.tie_margin"):
        assert f"{key}: Input should be a finite number" in str(err.value)
    assert "less than" not in str(err.value) and "greater than" not in str(err.value)


@pytest.mark.parametrize("preset", sorted(PPO_PRESETS))
def test_preset_fills_unset_switches(preset: str) -> None:
    config = load_config(PARAMS, overrides=[f"ppo.preset={preset}"])
    for switch, value in PPO_PRESETS[preset].items():
        assert getattr(config.ppo, switch) == value, switch


def test_explicit_switch_beats_preset() -> None:
    config = load_config(PARAMS, overrides=["ppo.preset=vanilla", "ppo.value_clip=0.3"])
    assert config.ppo.value_clip == 0.3
    assert config.ppo.kl_coef == PPO_PRESETS["vanilla"]["kl_coef"]


@pytest.mark.parametrize(
    ("former", "mode"),
    [
        (["ppo.length_residual=false"], "none"),
        (["ppo.length_residual=true"], "initial"),
        (["ppo.length_residual=true", "ppo.rollout_length_residual=false"], "initial"),
        (["ppo.rollout_length_residual=true"], "every_rollout"),  # beside params.yaml's length_residual: none
        (["ppo.length_residual=initial", "ppo.rollout_length_residual=false"], "initial"),
    ],
)
def test_the_former_length_residual_switches_are_read_as_the_mode_with_a_warning(former: list[str], mode: str) -> None:
    with pytest.warns(FutureWarning, match=f"read as ppo.length_residual: {mode}; write that instead"):
        config = load_config(PARAMS, overrides=former)
    assert config.ppo.length_residual == mode
    assert config == load_config(PARAMS, overrides=[f"ppo.length_residual={mode}"])  # the same run, the same hashes


@pytest.mark.parametrize(
    "former",
    [
        ["ppo.length_residual=true", "ppo.rollout_length_residual=true"],
        ["ppo.length_residual=every_rollout", "ppo.rollout_length_residual=false"],
    ],
)
def test_former_switches_that_mean_no_mode_are_refused_naming_both_keys_and_the_modes(former: list[str]) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(PARAMS, overrides=former)
    message = str(err.value)
    assert "ppo.rollout_length_residual" in message and "none | initial | every_rollout" in message


def test_params_yaml_leaves_switches_to_the_preset() -> None:
    """params.yaml must not pin a switch, or choosing the vanilla preset would silently keep it."""
    ppo_section = yaml.safe_load(PARAMS.read_text())["ppo"]
    assert not set(ppo_section) & set(PPO_PRESETS["ppo_max"])


def test_config_is_frozen() -> None:
    config = load_config(PARAMS)
    with pytest.raises(ValidationError):
        config.sft.lr = 1.0  # type: ignore[misc]


def test_section_hash_changes_only_with_its_section() -> None:
    a = load_config(PARAMS)
    b = load_config(PARAMS, overrides=["ppo.kl_coef=0.02"])
    assert a.section_hash("sft") == b.section_hash("sft")
    assert a.section_hash("ppo") != b.section_hash("ppo")


def test_a_key_given_twice_in_an_overlay_is_refused_with_file_and_line(tmp_path: Path) -> None:
    """PyYAML keeps the last of two equal keys, so the first `sft:` section would be lost silently."""
    overlay = write(tmp_path, "sft:\n  lr: 0.001\nreward:\n  lr: 0.002\nsft:\n  max_steps: 2\n")
    with pytest.raises(ConfigError, match=rf"{overlay}: line 5: duplicate key 'sft' \(first given on line 1\)"):
        load_config(PARAMS, overlays=[overlay])
    nested = write(tmp_path, "ppo:\n  steps: 3\n  rollout:\n    max_new_tokens: 8\n  steps: 4\n")
    with pytest.raises(ConfigError, match="line 5: duplicate key 'steps'"):
        load_config(PARAMS, overlays=[nested])
    with pytest.raises(ConfigError, match="override 'sft={lr: 1, lr: 2}': line 1: duplicate key 'lr'"):
        parse_override("sft={lr: 1, lr: 2}")


def test_yaml_merge_keys_are_not_duplicates(tmp_path: Path) -> None:
    overlay = write(tmp_path, "base: &shared\n  lr: 0.001\nsft:\n  <<: *shared\n  max_steps: 2\n")
    assert yaml.safe_load(overlay.read_text())["sft"] == {"lr": 0.001, "max_steps": 2}
    config = load_config(PARAMS, overlays=[write(tmp_path, "sft:\n  <<: {lr: 0.001}\n  max_steps: 2\n")])
    assert (config.sft.lr, config.sft.max_steps) == (0.001, 2)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("sft.max_steps=true", "sft.max_steps: expected an integer (null turns it off), got the boolean true"),
        ("seed=false", "seed: expected an integer, got the boolean false"),
        ("sft.lr=true", "sft.lr: expected a number, got the boolean true"),
        ("distributed.zero_stage=true", "distributed.zero_stage: expected an integer, got the boolean true"),
        ("ppo.rollout.max_new_tokens=true", "ppo.rollout.max_new_tokens: expected an integer, got the boolean true"),
        ("sft.skip=1", "sft.skip: expected true or false, got 1"),
        ("sft.lora.enabled=0", "sft.lora.enabled: expected true or false, got 0"),
        ("sft.skip='yes'", "sft.skip: expected true or false, got 'yes'"),
    ],
)
def test_booleans_and_numbers_are_not_interchangeable(override: str, message: str) -> None:
    """pydantic's lax mode would read `true` as 1 (one training step) and 1 as true."""
    with pytest.raises(ConfigError) as err:
        load_config(PARAMS, overrides=[override])
    assert str(err.value) == f"invalid configuration: {message}"


def test_a_mixup_is_reported_once_among_the_other_errors() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(PARAMS, overrides=["sft.lr=true", "reward.epochs=0"])
    text = str(err.value)
    assert text.count("sft.lr") == 1 and "sft.lr: expected a number" in text and "reward.epochs" in text


def test_true_false_null_and_numeric_strings_still_work() -> None:
    config = load_config(
        PARAMS, overrides=["sft.skip=true", "sft.max_steps=null", "ppo.policy_lr=2e-4", "ppo.steps=3.0"]
    )
    assert config.sft.skip is True and config.sft.max_steps is None
    assert config.ppo.policy_lr == 2e-4 and config.ppo.steps == 3
