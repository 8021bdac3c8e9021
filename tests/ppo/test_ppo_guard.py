"""The collapse guard: each bound stops the run with a message naming the bound, the value and the step."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from rlhf_core.config import CollapseGuardConfig, PromotionConfig
from rlhf_core.ppo.guard import (
    CollapseError,
    CollapseGuard,
    check_finite,
    check_kl,
    check_length_ratio,
    check_perplexity_drop,
)


def monitors(kl: float = 0.0, length: float = 20.0, perplexity: float = 10.0) -> dict[str, float]:
    return {"kl/token_k3": kl, "response/length_mean": length, "perplexity/policy": perplexity}


def test_kl_bound() -> None:
    check_kl(0.5, 0.5, step=3)  # at the bound is fine
    check_kl(100.0, None, step=3)  # no bound
    with pytest.raises(
        CollapseError, match=r"step 7: per-token KL to the reference 0.51 > max_kl 0.5 \[bound: max_kl\]"
    ):
        check_kl(0.51, 0.5, step=7)


@pytest.mark.parametrize(("length", "bound"), [(30.1, "max_length_ratio"), (13.3, "min_length_ratio")])
def test_length_ratio_band_both_ways(length: float, bound: str) -> None:
    check_length_ratio(30.0, 20.0, 0.67, 1.5, step=1)  # the ends of the band are within it
    check_length_ratio(13.4, 20.0, 0.67, 1.5, step=1)
    with pytest.raises(CollapseError, match=rf"step 4: mean response length .* times .* \[bound: {bound}\]") as error:
        check_length_ratio(length, 20.0, 0.67, 1.5, step=4)
    assert error.value.bound == bound and error.value.step == 4


def test_length_ratio_message_and_open_sides() -> None:
    with pytest.raises(
        CollapseError,
        match=r"step 29: mean response length 16.8 is 0.404 times the initial policy's 41.6, below min_length_ratio "
        r"0.67 \[bound: min_length_ratio\]",
    ):
        check_length_ratio(16.8, 41.6, 0.67, 1.5, step=29)  # the default run, stopped at step 29
    check_length_ratio(1.0, 41.6, None, 1.5, step=1)  # no lower bound: shortening is not checked
    check_length_ratio(400.0, 41.6, 0.67, None, step=1)  # no upper bound


def test_the_guard_s_length_band_is_the_promotion_gate_s() -> None:
    guard, gate = CollapseGuardConfig(), PromotionConfig()
    assert (guard.min_length_ratio, guard.max_length_ratio) == (gate.min_length_ratio, gate.max_length_ratio)
    assert (guard.min_length_ratio, guard.max_length_ratio) == (0.67, 1.5)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"min_length_ratio": 1.0, "max_length_ratio": 1.0}, "min_length_ratio 1 must be < max_length_ratio 1"),
        ({"min_length_ratio": 1.2}, "min_length_ratio"),
        ({"max_length_ratio": 0.9}, "max_length_ratio"),
        ({"min_length_ratio": 0.0}, "min_length_ratio"),
    ],
)
def test_a_length_band_that_excludes_the_initial_length_is_refused(settings: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        CollapseGuardConfig(**settings)


def test_the_guard_is_enabled_while_any_bound_is_set() -> None:
    off = {"max_kl": None, "min_length_ratio": None, "max_length_ratio": None, "max_perplexity_drop": None}
    assert CollapseGuardConfig().enabled and not CollapseGuardConfig(**off).enabled
    defaults = CollapseGuardConfig().model_dump()
    for bound in off:
        assert CollapseGuardConfig(**{**off, bound: defaults[bound]}).enabled, bound
    assert not CollapseGuardConfig(**off, length_window=4).enabled  # a window is no bound


def test_the_guard_reports_each_bound_it_has_and_a_length_band_off_as_such() -> None:
    assert CollapseGuardConfig().bounds_on() == {
        "guard_kl_bound": True,
        "guard_length_band": True,
        "guard_perplexity_bound": True,
    }
    assert CollapseGuardConfig().describe() == "KL <= 0.5; length band [0.67, 1.5]; perplexity drop <= 0.5"
    only_perplexity = CollapseGuardConfig(max_kl=None, min_length_ratio=None, max_length_ratio=None)
    assert only_perplexity.enabled  # on, but with neither bound the promotion gate needs
    assert only_perplexity.bounds_on() == {
        "guard_kl_bound": False,
        "guard_length_band": False,
        "guard_perplexity_bound": True,
    }
    assert only_perplexity.describe() == "KL bound off; length band off; perplexity drop <= 0.5"
    one_sided = CollapseGuardConfig(max_length_ratio=None, max_perplexity_drop=None)
    assert not one_sided.bounds_on()["guard_length_band"]
    assert one_sided.describe() == "KL <= 0.5; length band off (only min_length_ratio 0.67); perplexity bound off"


def test_perplexity_drop_bound() -> None:
    check_perplexity_drop(5.0, 10.0, 0.5, step=2)  # exactly a 50% drop is allowed
    check_perplexity_drop(30.0, 10.0, 0.5, step=2)  # a rise is not what this bound is about
    with pytest.raises(
        CollapseError, match=r"step 2: response perplexity 4.9 is 51.0% below .* \[bound: max_perplexity_drop\]"
    ):
        check_perplexity_drop(4.9, 10.0, 0.5, step=2)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_values_stop(value: float) -> None:
    check_finite("loss/policy", 1e30, step=1)
    with pytest.raises(CollapseError, match=rf"step 9: loss/policy is {value}.*\[bound: finite\]"):
        check_finite("loss/policy", value, step=9)


def test_guard_measures_drift_from_the_initial_policy_s_rollouts() -> None:
    bounds = CollapseGuardConfig(max_kl=0.5, min_length_ratio=0.67, max_length_ratio=1.5, max_perplexity_drop=0.2)
    guard = CollapseGuard(bounds)
    guard.check(monitors(length=18.0, perplexity=9.0), step=1, initial_policy=True)
    guard.check(monitors(length=22.0, perplexity=11.0), step=2, initial_policy=True)
    assert (guard.baseline_rollouts, guard.start_length, guard.start_perplexity) == (2, 20.0, 10.0)
    guard.check(monitors(kl=0.4, length=29.0, perplexity=8.5), step=3, initial_policy=False)
    assert (guard.start_length, guard.start_perplexity) == (20.0, 10.0)  # a trained policy's rollout is no baseline
    with pytest.raises(CollapseError, match="step 4.*max_length_ratio"):
        guard.check(monitors(length=31.0), step=4, initial_policy=False)
    with pytest.raises(CollapseError, match="step 4.*min_length_ratio"):
        guard.check(monitors(length=13.0), step=4, initial_policy=False)
    with pytest.raises(CollapseError, match="step 4.*max_perplexity_drop"):
        guard.check(monitors(perplexity=7.9), step=4, initial_policy=False)
    with pytest.raises(CollapseError, match="step 4.*max_kl"):
        guard.check(monitors(kl=0.6), step=4, initial_policy=False)
    with pytest.raises(CollapseError, match="step 4.*perplexity/policy is nan"):
        guard.check(monitors(perplexity=float("nan")), step=4, initial_policy=False)


def test_guard_needs_a_baseline_first() -> None:
    with pytest.raises(ValueError, match="baseline is empty"):
        CollapseGuard(CollapseGuardConfig()).check(monitors(), step=1, initial_policy=False)


def test_guard_baseline_survives_a_resume() -> None:
    bounds = CollapseGuardConfig(max_kl=None, min_length_ratio=None, max_length_ratio=1.5, max_perplexity_drop=None)
    guard = CollapseGuard(bounds)
    guard.check(monitors(length=20.0), step=1, initial_policy=True)
    resumed = CollapseGuard(bounds)
    resumed.load_state_dict(guard.state_dict())
    with pytest.raises(CollapseError, match="max_length_ratio"):
        resumed.check(monitors(length=31.0), step=5, initial_policy=False)  # measured against 20


def test_length_window_judges_the_mean_of_the_latest_rollouts() -> None:
    bounds = CollapseGuardConfig(max_kl=None, max_perplexity_drop=None, length_window=3)  # band [0.67, 1.5]
    guard = CollapseGuard(bounds)
    guard.check(monitors(length=20.0), step=1, initial_policy=True)
    guard.check(monitors(length=20.0), step=2, initial_policy=False)
    guard.check(monitors(length=12.0), step=3, initial_policy=False)  # alone 0.6x; (20 + 20 + 12) / 3 = 0.87x
    guard.check(monitors(length=16.0), step=4, initial_policy=False)  # (20 + 12 + 16) / 3 = 0.8x
    message = r"step 5: mean response length over the latest 3 rollouts 12.67 is 0.633 times"
    with pytest.raises(CollapseError, match=message) as error:
        guard.check(monitors(length=10.0), step=5, initial_policy=False)  # (12 + 16 + 10) / 3
    assert error.value.bound == "min_length_ratio"
    with pytest.raises(CollapseError, match="min_length_ratio"):  # window 1 (the default): the rollout alone
        single = CollapseGuard(CollapseGuardConfig(max_kl=None, max_perplexity_drop=None))
        single.check(monitors(length=20.0), step=1, initial_policy=True)
        single.check(monitors(length=12.0), step=2, initial_policy=False)


def test_the_length_window_survives_a_resume_and_older_checkpoints_load() -> None:
    bounds = CollapseGuardConfig(max_kl=None, max_perplexity_drop=None, length_window=2)
    guard = CollapseGuard(bounds)
    guard.check(monitors(length=20.0), step=1, initial_policy=True)
    guard.check(monitors(length=14.0), step=2, initial_policy=False)  # (20 + 14) / 2 = 0.85x
    resumed = CollapseGuard(bounds)
    resumed.load_state_dict(guard.state_dict())
    with pytest.raises(CollapseError, match="min_length_ratio"):
        resumed.check(monitors(length=12.0), step=3, initial_policy=False)  # (14 + 12) / 2 = 0.65x
    older = {key: value for key, value in guard.state_dict().items() if key != "recent_lengths"}
    fresh = CollapseGuard(bounds)
    fresh.load_state_dict(older)  # a checkpoint from before the window: its baseline, an empty window
    assert (fresh.start_length, fresh.recent_lengths) == (20.0, [])
    fresh.check(monitors(length=16.0), step=3, initial_policy=False)  # 16 / 20 = 0.8x


def test_within_kl_bound() -> None:
    assert CollapseGuard(CollapseGuardConfig(max_kl=0.1)).within_kl_bound(0.1)
    assert not CollapseGuard(CollapseGuardConfig(max_kl=0.1)).within_kl_bound(0.11)
    assert CollapseGuard(CollapseGuardConfig(max_kl=None)).within_kl_bound(1e9)
