"""The ablation grid: the shipped grids resolve to the paper's comparisons, each variant's settings come from
its preset and overrides over the base, and every bad variant is refused before anything runs, by name
and key."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml

from fixtures.paths import PARAMS, ROOT, TINY
from rlhf_core.ablation.grid import GridSpec, VariantSpec, plan_ablation, read_grid
from rlhf_core.config import PPO_PRESETS, ConfigError

GRIDS = ROOT / "configs" / "ablations"


def switches(variant) -> dict[str, object]:
    return {name: getattr(variant.config.ppo, name) for name in PPO_PRESETS["ppo_max"]}


def differences(variant, preset: str) -> dict[str, object]:
    """The variant's Figure 5 switches that differ from `preset`'s."""
    return {name: value for name, value in switches(variant).items() if value != PPO_PRESETS[preset][name]}


def write_grid(path: Path, variants: list[dict]) -> Path:
    path.write_text(yaml.safe_dump({"variants": variants}))
    return path


def test_the_paper_grid_is_vanilla_ppo_max_and_ppo_max_without_each_detail() -> None:
    plan = plan_ablation(read_grid(GRIDS / "paper.yaml"), PARAMS)
    by_name = {variant.name: variant for variant in plan.variants}
    assert switches(by_name["vanilla"]) == PPO_PRESETS["vanilla"]
    assert switches(by_name["ppo_max"]) == PPO_PRESETS["ppo_max"]
    assert {
        name: differences(variant, "ppo_max") for name, variant in by_name.items() if name.startswith("ppo_max-")
    } == {
        "ppo_max-no_reward_norm": {"reward_normalization": False, "reward_clip": None},
        "ppo_max-no_value_clip": {"value_clip": None},
        "ppo_max-no_critic_pretrain": {"critic_pretrain_steps": 0},
        "ppo_max-no_kl": {"kl_coef": 0.0},
        "ppo_max-critic_from_sft": {"critic_init": "sft"},
    }
    base = plan.base_config.model_dump(exclude={"ppo"})
    assert all(variant.config.model_dump(exclude={"ppo"}) == base for variant in plan.variants)  # one shared base


def test_the_learning_rate_grid_raises_only_the_policy_learning_rate() -> None:
    plan = plan_ablation(read_grid(GRIDS / "learning-rate.yaml"), PARAMS)
    rates = {variant.name: variant.config.ppo.policy_lr for variant in plan.variants}
    recipe = plan.base_config.ppo.policy_lr
    assert rates == {
        "vanilla": recipe, "ppo_max": recipe, "vanilla-lr5e-5": 5e-5, "ppo_max-lr5e-5": 5e-5,
        "vanilla-lr1e-4": 1e-4, "ppo_max-lr1e-4": 1e-4,
    }  # fmt: skip
    for variant in plan.variants:
        assert differences(variant, variant.spec.preset) == {}


def test_the_unguarded_grid_raises_the_rate_and_switches_off_only_the_guard() -> None:
    plan = plan_ablation(read_grid(GRIDS / "unguarded.yaml"), PARAMS)
    assert [(variant.name, variant.spec.preset) for variant in plan.variants] == [
        ("vanilla-lr5e-5-unguarded", "vanilla"), ("ppo_max-lr5e-5-unguarded", "ppo_max"),
    ]  # fmt: skip
    for variant in plan.variants:
        ppo = variant.config.ppo
        assert ppo.policy_lr == 5e-5
        assert ppo.guard.model_dump() == {
            "max_kl": None, "min_length_ratio": None, "max_length_ratio": None, "max_perplexity_drop": None,
            "length_window": 1,
        }  # fmt: skip
        assert not ppo.guard.enabled
        assert differences(variant, variant.spec.preset) == {}  # the Figure 5 switches are the preset's


def test_the_length_grid_changes_one_lever_per_variant() -> None:
    plan = plan_ablation(read_grid(GRIDS / "length.yaml"), PARAMS)
    base = plan.base_config.ppo
    by_name = {variant.name: variant.config.ppo for variant in plan.variants}
    assert by_name["vanilla-no_length_guard"].guard.min_length_ratio is None
    assert by_name["vanilla-no_length_guard"].guard.max_kl == base.guard.max_kl  # the other bounds stay
    assert by_name["ppo_max-no_unfinished_penalty"].unfinished_penalty == 0.0 != base.unfinished_penalty
    assert by_name["ppo_max-cap128"].rollout.max_new_tokens == 128 != base.rollout.max_new_tokens
    window = by_name["ppo_max-cap128-window4"]
    assert (
        (window.rollout.max_new_tokens, window.guard.length_window)
        == (128, 4)
        != (base.rollout.max_new_tokens, base.guard.length_window)
    )
    assert by_name["ppo_max-kl0.05"].kl_coef == 0.05 != base.kl_coef
    assert by_name["ppo_max-lr2e-5"].policy_lr == 2e-5 != base.policy_lr
    assert by_name["ppo_max-epochs1"].ppo_epochs == 1 != base.ppo_epochs
    assert by_name["ppo_max-window4"].guard.length_window == 4 != base.guard.length_window
    slow = by_name["ppo_max-window4-epochs1"]
    assert (slow.guard.length_window, slow.ppo_epochs) == (4, 1) != (base.guard.length_window, base.ppo_epochs)
    assert by_name["ppo_max-critic_sft"].critic_init == "sft" != base.critic_init
    assert by_name["ppo_max-rollout_length_residual"].length_residual == "every_rollout" != base.length_residual
    finishing = by_name["ppo_max-every_rollout-window4-no_unfinished_penalty"]
    assert (finishing.length_residual, finishing.guard.length_window, finishing.unfinished_penalty) == (
        "every_rollout", 4, 0.0,
    ) != (base.length_residual, base.guard.length_window, base.unfinished_penalty)  # fmt: skip
    preset_levers = {"ppo_max-kl0.05": {"kl_coef": 0.05}, "ppo_max-critic_sft": {"critic_init": "sft"}}
    for variant in plan.variants:  # of the preset's switches, only these two are levers here
        assert differences(variant, variant.spec.preset) == preset_levers.get(variant.name, {})


def test_base_switches_refine_their_own_preset_and_are_dropped_for_another() -> None:
    # configs/tiny.yaml sets ppo.critic_pretrain_steps: 1 over the base's ppo_max preset
    grid = GridSpec(
        variants=[
            VariantSpec(name="vanilla", preset="vanilla"),
            VariantSpec(name="ppo_max", preset="ppo_max"),
            VariantSpec(name="no_pretrain", preset="ppo_max", overrides=["ppo.critic_pretrain_steps=0"]),
        ]
    )
    vanilla, ppo_max, no_pretrain = plan_ablation(grid, PARAMS, [TINY]).variants
    assert switches(vanilla) == PPO_PRESETS["vanilla"] and vanilla.dropped == {"critic_pretrain_steps": 1}
    assert ppo_max.config.ppo.critic_pretrain_steps == 1 and ppo_max.inherited == {"critic_pretrain_steps": 1}
    assert ppo_max.settings_label() == "ppo_max; critic_pretrain_steps=1 (base)"
    assert no_pretrain.config.ppo.critic_pretrain_steps == 0 and no_pretrain.inherited == {}  # the override wins
    assert vanilla.config.ppo.steps == ppo_max.config.ppo.steps == 3  # scale comes from the base for all


def test_bad_variants_are_refused_together_naming_each_variant_and_key(tmp_path: Path) -> None:
    path = write_grid(
        tmp_path / "bad.yaml",
        [
            {"name": "fine", "preset": "ppo_max"},
            {"name": "typo", "preset": "ppo_max", "overrides": ["ppo.value_clipp=null"]},
            {"name": "out_of_range", "preset": "vanilla", "overrides": ["ppo.clip_eps=1.5"]},
            {"name": "not_ppo", "preset": "ppo_max", "overrides": ["sft.lr=0.1"]},
        ],
    )
    with pytest.raises(ConfigError) as error:
        plan_ablation(read_grid(path), PARAMS)
    message = str(error.value)
    assert "variant 'typo': ppo.value_clipp: unknown key" in message
    assert "variant 'out_of_range': ppo.clip_eps: Input should be less than 1 (got 1.5)" in message
    assert "variant 'not_ppo': override 'sft.lr=0.1' sets sft: a variant may set only ppo.* keys" in message
    assert "'fine'" not in message


@pytest.mark.parametrize(
    ("variants", "expected"),
    [
        ([{"name": "a", "preset": "ppo_maxx"}], "variants.0.preset: unknown preset; allowed: ppo_max, vanilla"),
        ([{"name": "a", "preset": "vanilla"}, {"name": "a", "preset": "ppo_max"}], "repeated: a"),
        ([{"name": "a/b", "preset": "vanilla"}], "variants.0.name: expected letters, digits"),
        ([{"name": "a", "preset": "vanilla", "override": []}], "variants.0.override: Extra inputs are not permitted"),
        ([], "variants: List should have at least 1 item"),
    ],
)
def test_a_malformed_grid_file_names_the_entry(tmp_path: Path, variants: list[dict], expected: str) -> None:
    with pytest.raises(ConfigError, match="invalid ablation grid .*bad.yaml: ") as error:
        read_grid(write_grid(tmp_path / "bad.yaml", variants))
    assert expected in str(error.value)


def test_two_variants_with_the_same_settings_would_be_one_run_and_are_refused() -> None:
    grid = GridSpec(
        variants=[
            VariantSpec(name="ppo_max", preset="ppo_max"),
            VariantSpec(name="same", preset="ppo_max", overrides=["ppo.kl_coef=0.01"]),
        ]
    )
    with pytest.raises(ConfigError, match="variants 'ppo_max' and 'same' resolve to the same PPO settings"):
        plan_ablation(grid, PARAMS)


def test_only_selects_variants_and_refuses_unknown_names() -> None:
    grid = read_grid(GRIDS / "paper.yaml")
    assert [variant.name for variant in plan_ablation(grid, PARAMS, only=["ppo_max", "vanilla"]).variants] == [
        "vanilla",
        "ppo_max",
    ]
    with pytest.raises(ConfigError, match="no variant named 'ppo-max'; the grid has"):
        plan_ablation(grid, PARAMS, only=["ppo-max"])


@pytest.mark.slow  # imports the orchestration stack (Prefect, MLflow), which runs `uname` and takes seconds
def test_rlhf_ablate_refuses_a_bad_variant_before_the_flow_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import flows.ablation
    from rlhf_cli.main import main

    def must_not_run(settings):
        raise AssertionError("the flow started although a variant is invalid")

    monkeypatch.setattr(flows.ablation, "rlhf_ablation", must_not_run)
    monkeypatch.chdir(tmp_path)
    grid = write_grid(tmp_path / "grid.yaml", [{"name": "bad", "preset": "ppo_max", "overrides": ["ppo.kl_coef=-1"]}])
    argv = ["rlhf", "ablate", "--grid", str(grid), "--base", str(tmp_path), "--params", str(PARAMS)]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as exited:
        main()
    assert exited.value.code == 2
    assert capsys.readouterr().err.startswith(
        "rlhf: error: invalid ablation grid grid: variant 'bad': ppo.kl_coef: Input should be greater than or "
        "equal to 0"
    )
    assert not (tmp_path / "runs").exists()
