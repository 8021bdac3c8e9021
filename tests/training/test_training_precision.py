"""Precision: what `distributed.bf16` resolves to on each machine, bf16 autocast on the CPU, float32 kept
where precision decides (the heads, log-probabilities, the PPO ratio and KL), and bf16 training reaching
float32's loss."""

from pathlib import Path

import pytest
import torch
from torch import nn

from fixtures.tiny_ppo import tiny_config
from rlhf_core import bf16_probe
from rlhf_core.bf16_probe import MatmulRates, cached_rates
from rlhf_core.config import Config, ConfigError, DistributedConfig
from rlhf_core.models.heads import in_float32
from rlhf_core.models.tiny import build_tiny_model
from rlhf_core.ppo.kl import kl_k1
from rlhf_core.ppo.losses import policy_loss
from rlhf_core.ppo.scoring import response_logprobs
from rlhf_core.stages.precision import with_precision
from rlhf_core.training.precision import PrecisionSetting, autocast, choose_precision

CPU = torch.device("cpu")
FAST = MatmulRates(native_bf16=True, float32_gflops=90.0, bfloat16_gflops=190.0)  # this pool's EPYC
SLOW = MatmulRates(native_bf16=True, float32_gflops=90.0, bfloat16_gflops=100.0)
NO_UNITS = MatmulRates(native_bf16=False, float32_gflops=90.0, bfloat16_gflops=0.0)


def never_measured() -> MatmulRates:
    raise AssertionError("only auto on a CPU times the CPU")


@pytest.mark.parametrize("setting, bf16", [("off", False), ("on", True)])
def test_off_and_on_decide_without_timing_the_cpu(setting: PrecisionSetting, bf16: bool) -> None:
    choice = choose_precision(setting, CPU, never_measured)
    assert choice.bf16 is bf16
    assert f"distributed.bf16 = {setting}" in choice.reason


@pytest.mark.parametrize(
    "rates, bf16, words",
    [
        (FAST, True, ["2.11x", "190 vs 90"]),
        (SLOW, False, ["1.11x", "under the 1.25x"]),
        (NO_UNITS, False, ["no native"]),
    ],
)
def test_auto_takes_bf16_only_where_the_probe_says_it_is_faster(
    rates: MatmulRates, bf16: bool, words: list[str]
) -> None:
    choice = choose_precision("auto", CPU, lambda: rates)
    assert choice.bf16 is bf16
    assert all(word in choice.reason for word in words), choice.reason


def test_the_probe_times_each_cpu_once_and_keeps_the_answer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    measured: list[MatmulRates] = []
    monkeypatch.setattr(bf16_probe, "measure_rates", lambda: measured.append(FAST) or FAST)
    cache = tmp_path / "probe.json"
    assert cached_rates(cache) == FAST
    assert cached_rates(cache) == FAST
    assert len(measured) == 1
    monkeypatch.setattr(bf16_probe, "cpu_identity", lambda: "another-cpu")
    cached_rates(cache)
    assert len(measured) == 2


def test_the_probe_measures_this_cpu() -> None:
    rates = bf16_probe.measure_rates()
    assert rates.float32_gflops > 0
    assert rates.native_bf16 == bf16_probe.native_bf16()
    assert (rates.bfloat16_gflops > 0) == rates.native_bf16


def test_the_setting_reads_yaml_booleans_and_names_the_allowed_values() -> None:
    assert DistributedConfig(bf16=True).bf16 == "on"
    assert DistributedConfig(bf16=False).bf16 == "off"
    with pytest.raises(ConfigError, match=r"distributed\.bf16.*'auto', 'on' or 'off'"):
        tiny_config("distributed.bf16=sometimes")
    with pytest.raises(ValueError, match="resolve it for the device first"):
        assert not DistributedConfig(bf16="auto").uses_bf16


def test_a_resolved_config_names_the_precision_and_the_engines_dtype() -> None:
    bf16, fp32 = with_precision(Config(), True), with_precision(Config(), False)
    assert (bf16.distributed.bf16, fp32.distributed.bf16) == ("on", "off")
    assert (bf16.ppo.rollout.dtype, bf16.evaluation.generation.dtype) == ("bfloat16", "bfloat16")
    assert (fp32.ppo.rollout.dtype, fp32.evaluation.generation.dtype) == ("float32", "float32")
    hf = tiny_config("ppo.rollout.engine=hf", "evaluation.generation.dtype=float32")
    resolved = with_precision(hf, True)
    assert (resolved.ppo.rollout.dtype, resolved.evaluation.generation.dtype) == ("float32", "float32")


def test_cpu_autocast_multiplies_in_bf16_and_keeps_the_weights_float32() -> None:
    layer = nn.Linear(8, 8)
    with autocast(CPU, True):
        assert layer(torch.randn(2, 8)).dtype == torch.bfloat16
    with autocast(CPU, False):
        assert layer(torch.randn(2, 8)).dtype == torch.float32
    assert layer.weight.dtype == torch.float32


def test_heads_compute_in_float32_under_autocast() -> None:
    torch.manual_seed(0)
    head, hidden = nn.Linear(16, 500, bias=False), torch.randn(2, 5, 16)
    with autocast(CPU, True):
        logits = in_float32(head, hidden)
    assert logits.dtype == torch.float32
    assert torch.equal(logits, head(hidden))  # the float32 product itself, not a bf16 one upcast


def test_ppo_log_probabilities_ratio_and_kl_are_float32_under_autocast(tokenizer) -> None:
    policy, reference = build_tiny_model(tokenizer, seed=1), build_tiny_model(tokenizer, seed=2)
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 1000, (3, 6), generator=generator), torch.ones(3, 6, dtype=torch.long)
    response = torch.randint(0, 1000, (3, 5), generator=generator), torch.ones(3, 5, dtype=torch.long)
    with torch.no_grad():
        exact = response_logprobs(policy, *prompt, *response, 1.0)[0]
        with autocast(CPU, True):
            logp = response_logprobs(policy, *prompt, *response, 1.0)[0]
            ref_logp = response_logprobs(reference, *prompt, *response, 1.0)[0]
            loss, stats = policy_loss(logp, exact, torch.ones(3, 5), response[1], clip_eps=0.2)
            kl = kl_k1(logp, ref_logp)
    assert {logp.dtype, ref_logp.dtype, loss.dtype, stats.ratio_mean.dtype, kl.dtype} == {torch.float32}
    assert (logp - exact).abs().max() < 0.05  # the blocks' bf16 rounding only: the head and softmax are float32


def test_bf16_training_of_the_tiny_model_reaches_float32s_loss(tokenizer) -> None:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 2000, (4, 24), generator=generator)
    final = {}
    for bf16 in (False, True):
        model = build_tiny_model(tokenizer, seed=0)
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        for _ in range(30):
            with autocast(CPU, bf16):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        final[bf16] = loss.item()
        assert all(parameter.dtype == torch.float32 for parameter in model.parameters())
    initial = torch.log(torch.tensor(float(len(tokenizer)))).item()  # a random model's loss
    assert final[False] < 0.5 * initial  # it learned the batch
    assert abs(final[True] - final[False]) < 0.05 * (initial - final[False])
