"""Rollout engines on the tiny model: the lean engine draws the reference (`generate`) engine's tokens with
the `multinomial` sampler and a plain reference loop's with `inverse_cdf`, stops and pads as `generate` does,
follows the policy's weights, and any engine behind the protocol runs the trainer.

Every comparison runs both engines from the same seed on the same left-padded prompts (different lengths).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import Tensor
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from fixtures.tiny_ppo import tiny_config
from rlhf_core.config import LoraConfig, RolloutConfig
from rlhf_core.models.chat import encode_prompt, end_of_turn_id
from rlhf_core.models.heads import Critic, RewardModel
from rlhf_core.models.lora import add_lora_adapters
from rlhf_core.models.tiny import build_tiny_model
from rlhf_core.ppo.experience_maker import PPOModels
from rlhf_core.ppo.scoring import RewardModelScorer, response_logprobs
from rlhf_core.ppo.shared_trunk import SharedTrunk
from rlhf_core.ppo.trainer import PPOData, PPOTrainer, fit
from rlhf_core.rollout import decode_weights
from rlhf_core.rollout.engine import Generation, HFGenerateEngine, SamplingParams, finish_replies
from rlhf_core.rollout.engines import make_rollout_engine
from rlhf_core.rollout.generation import left_pad, stop_token_ids
from rlhf_core.rollout.lean_engine import LeanEngine, logits_processors

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "user", "content": "Name a colour, and say why you like it best of all."}],
    [{"role": "user", "content": "Count to three."}],
]
SETTINGS = [
    {"temperature": 1.0},
    {"temperature": 0.7},
    {"temperature": 1.3, "top_p": 0.9, "repetition_penalty": 1.1},  # the paper's (off-policy) settings
]
FP32_LOGPROB_TOLERANCE = 1e-4  # the lean engine's own log-probs vs the float32 scoring pass's
BF16_LOGPROB_TOLERANCE = 0.01  # bf16 weights: mean gap ~7e-4 here, 0.03 on SmolLM2 (docs/rollout-engine.md)


@pytest.fixture(scope="module")
def prompt(tokenizer: PreTrainedTokenizerBase) -> tuple[Tensor, Tensor]:
    return left_pad([encode_prompt(tokenizer, messages) for messages in PROMPTS], tokenizer.pad_token_id)


def params(tokenizer: PreTrainedTokenizerBase, max_new_tokens: int = 10, **settings: float | str) -> SamplingParams:
    """Sampling settings; the lean engine draws as `generate` does (`multinomial`) unless told otherwise,
    as most tests compare its tokens with the reference engine's."""
    rollout = RolloutConfig(max_new_tokens=max_new_tokens, **{"sampler": "multinomial", **settings})
    return SamplingParams(rollout, tuple(stop_token_ids(tokenizer)), tokenizer.pad_token_id)


@torch.no_grad()
def reference_inverse_cdf_rollout(
    model: PreTrainedModel, prompt: tuple[Tensor, Tensor], sampling: SamplingParams, seed: int
) -> Tensor:
    """`generate`'s sampling loop written out plainly, drawing as the `inverse_cdf` sampler does: the
    model's full forward pass over everything so far at each step (no cache), the same processors, one
    float64 uniform per row located in the float64 cumulative sum of the probabilities."""
    ids, mask = prompt
    processors = logits_processors(sampling.settings)
    stops = torch.tensor(sampling.stop_ids)
    unfinished = torch.ones(ids.shape[0], dtype=torch.bool)
    generated = []
    torch.manual_seed(seed)
    for _ in range(sampling.settings.max_new_tokens):
        positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, -1].float()
        probs = torch.softmax(processors(ids, logits), dim=-1)
        cumulative = probs.double().cumsum(dim=-1)
        uniform = torch.rand(ids.shape[0], dtype=torch.float64)
        token = torch.searchsorted(cumulative, (uniform * cumulative[:, -1])[:, None], right=True).squeeze(1)
        token = torch.where(unfinished, token, sampling.pad_id)
        generated.append(token)
        unfinished &= ~torch.isin(token, stops)
        ids, mask = torch.cat([ids, token[:, None]], dim=1), torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        if not bool(unfinished.any()):
            break
    return torch.stack(generated, dim=1)


def stop_prone_model(tokenizer: PreTrainedTokenizerBase) -> PreTrainedModel:
    """A tiny model whose replies end after a few tokens, at different steps: the final norm keeps one
    coordinate of the hidden state, and the end-of-turn row of the tied LM head reads it with a large
    weight, so end-of-turn wins whenever that coordinate is clearly positive (seed and coordinate chosen
    so that with 12 tokens some rows finish, some are cut, and one batch finishes early)."""
    model = build_tiny_model(tokenizer, seed=6)
    with torch.no_grad():
        model.model.norm.weight.zero_()[11] = 1.0
        model.get_output_embeddings().weight[end_of_turn_id(tokenizer), 11] = 15.0
    return model


def same_generation(left: Generation, right: Generation) -> bool:
    return all(
        torch.equal(a, b)
        for a, b in [
            (left.response_ids, right.response_ids),
            (left.response_mask, right.response_mask),
            (left.finished, right.finished),
        ]
    )


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_lean_engine_draws_the_reference_engines_tokens_and_log_probs(
    tokenizer: PreTrainedTokenizerBase, prompt: tuple[Tensor, Tensor], settings: dict[str, float]
) -> None:
    model = build_tiny_model(tokenizer, seed=6)
    sampling = params(tokenizer, **settings)
    reference, lean = HFGenerateEngine(model), LeanEngine(model, sampling.settings, rollout_batch_size=3)
    temperature = sampling.settings.temperature
    for seed in range(3):
        expected, got = reference.generate(*prompt, sampling, seed=seed), lean.generate(*prompt, sampling, seed=seed)
        assert same_generation(expected, got), seed
        with torch.no_grad():
            scored = response_logprobs(model, *prompt, got.response_ids, got.response_mask, temperature)[0]
            reference_scored = response_logprobs(
                model, *prompt, expected.response_ids, expected.response_mask, temperature
            )[0]
        assert torch.equal(scored, reference_scored)  # what PPO trains on: the same, bit for bit
        if settings.get("top_p", 1.0) == 1.0 and settings.get("repetition_penalty", 1.0) == 1.0:
            # pure temperature: the engine sampled exactly the distribution the scoring pass measures
            assert got.logprobs is not None
            assert (got.logprobs - scored).abs().max() < FP32_LOGPROB_TOLERANCE


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_inverse_cdf_sampler_draws_what_the_plain_reference_loop_draws(
    tokenizer: PreTrainedTokenizerBase, prompt: tuple[Tensor, Tensor], settings: dict[str, float]
) -> None:
    model = stop_prone_model(tokenizer)
    sampling = params(tokenizer, max_new_tokens=12, sampler="inverse_cdf", **settings)
    lean = LeanEngine(model, sampling.settings, rollout_batch_size=3)
    finished_rows = 0
    for seed in range(3):
        got = lean.generate(*prompt, sampling, seed=seed)
        expected = reference_inverse_cdf_rollout(model, prompt, sampling, seed)
        ids, mask, _ = finish_replies(expected, sampling)
        assert torch.equal(got.response_ids, ids) and torch.equal(got.response_mask, mask), seed
        finished_rows += int(got.finished.sum())
    assert finished_rows > 0  # replies that stopped early were compared too


def test_generation_stops_at_end_of_turn_and_pads_after_it(
    tokenizer: PreTrainedTokenizerBase, prompt: tuple[Tensor, Tensor]
) -> None:
    model, eot, pad = stop_prone_model(tokenizer), end_of_turn_id(tokenizer), tokenizer.pad_token_id
    sampling = params(tokenizer, max_new_tokens=12)
    lean, reference = LeanEngine(model, sampling.settings, 3), HFGenerateEngine(model)
    lengths, widths = set(), set()
    for seed in range(4):
        got = lean.generate(*prompt, sampling, seed=seed)
        assert same_generation(got, reference.generate(*prompt, sampling, seed=seed))
        for row in range(3):
            ids, mask = got.response_ids[row].tolist(), got.response_mask[row].tolist()
            length = sum(mask)
            assert mask == [1] * length + [0] * (len(mask) - length)
            assert ids[length:] == [pad] * (len(ids) - length)
            assert bool(got.finished[row]) == (eot in ids[:length]) and eot not in ids[: length - 1]
            if got.finished[row]:
                assert ids[length - 1] == eot
            lengths.add(length)
        widths.add(got.response_ids.shape[1])
        if bool(got.finished.all()):  # generation ends with the step on which the last row finished
            assert got.response_mask[:, -1].any()
        else:
            assert got.response_ids.shape[1] == 12
    assert len(lengths) > 2 and 12 in lengths  # rows stopped at different steps, and some were cut
    assert min(widths) < 12  # a batch whose every row finished early


def test_sync_weights_rebuilds_what_changed_and_follows_the_policy(
    tokenizer: PreTrainedTokenizerBase, prompt: tuple[Tensor, Tensor]
) -> None:
    model = build_tiny_model(tokenizer, seed=6).requires_grad_(False)
    sampling = params(tokenizer)
    lean, reference = LeanEngine(model, sampling.settings, 3), HFGenerateEngine(model)
    assert lean.weights.refresh(model) == 0  # nothing trains, nothing changed
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight.mul_(3.0)
    stale = lean.generate(*prompt, sampling, seed=0)
    assert lean.weights.refresh(model) == 1  # only block 1
    assert same_generation(lean.generate(*prompt, sampling, seed=0), reference.generate(*prompt, sampling, seed=0))
    assert not same_generation(stale, reference.generate(*prompt, sampling, seed=0))
    model.model.layers[0].requires_grad_(True)
    assert lean.weights.refresh(model) == 1  # a block that trains is rebuilt every time


def test_the_trunk_states_handed_back_are_the_trunk_pass_ones(
    tokenizer: PreTrainedTokenizerBase, prompt: tuple[Tensor, Tensor]
) -> None:
    """Residual entering block 1, at every real column of prompt and reply (replies that stop early too)."""
    model = stop_prone_model(tokenizer)
    sampling = params(tokenizer, max_new_tokens=12)
    got = LeanEngine(model, sampling.settings, 3, trunk_layers=1).generate(*prompt, sampling, seed=1)
    assert got.trunk_residual is not None and not bool(got.finished.all())
    trunk = SharedTrunk(backbone=model.model, num_lower=1, members=frozenset({"reference"}))
    expected = trunk.states(prompt, (got.response_ids, got.response_mask), micro_batch_size=2).residual
    real = torch.cat([prompt[1], got.response_mask], dim=1).bool()
    assert got.trunk_residual.shape == expected.shape
    torch.testing.assert_close(got.trunk_residual[real], expected[real], atol=1e-5, rtol=1e-5)


def test_lora_adapters_are_merged_into_the_engines_weights(
    tokenizer: PreTrainedTokenizerBase, prompt: tuple[Tensor, Tensor]
) -> None:
    model = build_tiny_model(tokenizer, seed=6)
    add_lora_adapters(model, LoraConfig(enabled=True, r=4, alpha=8), top_layers=1, seed=0)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(1))
    model.eval()
    sampling = params(tokenizer)
    lean, reference = LeanEngine(model, sampling.settings, 3), HFGenerateEngine(model)
    for seed in range(2):
        expected = reference.generate(*prompt, sampling, seed=seed)
        assert same_generation(lean.generate(*prompt, sampling, seed=seed), expected)


def test_bf16_weights_stay_within_the_stated_log_prob_error(
    tokenizer: PreTrainedTokenizerBase, prompt: tuple[Tensor, Tensor]
) -> None:
    model = build_tiny_model(tokenizer, seed=6)
    sampling = params(tokenizer, dtype="bfloat16")
    got = LeanEngine(model, sampling.settings, 3).generate(*prompt, sampling, seed=0)
    with torch.no_grad():
        scored = response_logprobs(model, *prompt, got.response_ids, got.response_mask, 1.0)[0]
    real = got.response_mask.bool()
    assert got.logprobs is not None
    gap = (got.logprobs - scored).abs()[real]
    assert 0 < gap.mean() < BF16_LOGPROB_TOLERANCE  # not float32 (> 0), yet close


def sampled_statistics(
    engine: LeanEngine | HFGenerateEngine,
    model: PreTrainedModel,
    prompt: tuple[Tensor, Tensor],
    sampling: SamplingParams,
) -> tuple[Tensor, Tensor]:
    """Reply lengths and the float32 policy's log-probabilities of every sampled token, over 40 seeds."""
    lengths, logprobs = [], []
    for seed in range(40):
        got = engine.generate(*prompt, sampling, seed=seed)
        with torch.no_grad():
            scored = response_logprobs(model, *prompt, got.response_ids, got.response_mask, 1.0)[0]
        lengths.append(got.response_mask.sum(dim=1).double())
        logprobs.append(scored[got.response_mask.bool()].double())
    return torch.cat(lengths), torch.cat(logprobs)


def test_bf16_engine_samples_the_distribution_generate_samples_in_bf16(
    tokenizer: PreTrainedTokenizerBase, prompt: tuple[Tensor, Tensor]
) -> None:
    """Token for token only in float32 (above): in bf16 the engine's kernels and `generate`'s round
    differently, so their samples are compared by distribution, as two samples of the same law: the mean
    reply length and the mean log-probability of the sampled tokens, within 4 standard errors."""
    model = stop_prone_model(tokenizer)
    sampling = params(tokenizer, max_new_tokens=12, sampler="inverse_cdf", dtype="bfloat16")
    lean = sampled_statistics(LeanEngine(model, sampling.settings, 3), model, prompt, sampling)
    bf16_model = build_tiny_model(tokenizer, seed=6)
    bf16_model.load_state_dict(model.state_dict())
    generate = sampled_statistics(HFGenerateEngine(bf16_model.to(torch.bfloat16)), model, prompt, sampling)
    assert len(set(lean[0].tolist())) > 3  # replies of many lengths: the comparison sees when they stop
    for ours, theirs in zip(lean, generate):
        standard_error = (ours.var() / len(ours) + theirs.var() / len(theirs)).sqrt()
        assert abs(ours.mean() - theirs.mean()) < 4 * standard_error


@pytest.mark.parametrize("native", [True, False])
def test_bf16_weights_use_onednn_only_where_the_cpu_has_native_bf16(
    native: bool, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(decode_weights, "native_bf16", lambda: native)
    layout = decode_weights.choose_layout(torch.device("cpu"), torch.bfloat16, "blocked")
    assert layout == ("reordered" if native else "plain")  # oneDNN refuses a bf16 reorder without it
    assert ("without native bf16" in caplog.text) is not native


def test_a_seed_gives_its_own_stream_and_leaves_the_global_one(
    tokenizer: PreTrainedTokenizerBase, prompt: tuple[Tensor, Tensor]
) -> None:
    model = build_tiny_model(tokenizer, seed=6)
    sampling = params(tokenizer, sampler="inverse_cdf")
    lean = LeanEngine(model, sampling.settings, 3)
    torch.manual_seed(123)
    state = torch.random.get_rng_state()
    first, second = lean.generate(*prompt, sampling, seed=5), lean.generate(*prompt, sampling, seed=5)
    assert same_generation(first, second) and torch.equal(torch.random.get_rng_state(), state)
    torch.manual_seed(5)
    assert same_generation(lean.generate(*prompt, sampling), first)  # seed=None: the global stream


def test_engine_choice_is_checked(tokenizer: PreTrainedTokenizerBase) -> None:
    model = build_tiny_model(tokenizer, seed=0)
    assert isinstance(make_rollout_engine(RolloutConfig(engine="hf"), model, 4), HFGenerateEngine)
    assert isinstance(make_rollout_engine(RolloutConfig(engine="lean"), model, 4), LeanEngine)
    with pytest.raises(ValueError, match="dtype bfloat16 needs engine lean"):
        make_rollout_engine(RolloutConfig(engine="hf", dtype="bfloat16"), model, 4)
    model.config.model_type = "gpt2"
    with pytest.raises(ValueError, match="the lean rollout engine cannot run this model: model type 'gpt2'"):
        LeanEngine(model, RolloutConfig(), 4)


class ScriptedEngine:
    """A test double behind the engine protocol: a fixed reply per prompt, and a log of its calls."""

    def __init__(self, reply: list[int], pad_id: int) -> None:
        self.reply, self.pad_id = reply, pad_id
        self.calls: list[str] = []

    def sync_weights(self, policy: PreTrainedModel) -> None:
        self.calls.append("sync")

    def generate(
        self, prompt_ids: Tensor, prompt_mask: Tensor, params: SamplingParams, seed: int | None = None
    ) -> Generation:
        self.calls.append("generate")
        batch = prompt_ids.shape[0]
        ids = torch.tensor(self.reply).repeat(batch, 1)
        return Generation(ids, torch.ones_like(ids), torch.ones(batch, dtype=torch.bool))


@pytest.mark.slow  # the checkpoint save imports DeepSpeed, which runs `uname`
def test_an_engine_behind_the_protocol_runs_the_trainer(tokenizer: PreTrainedTokenizerBase, tmp_path: Path) -> None:
    config = tiny_config("ppo.steps=2", "ppo.critic_pretrain_steps=0", "ppo.eval_every=2", "ppo.val_prompts=2").ppo
    reward_model = RewardModel.from_causal_lm(build_tiny_model(tokenizer, seed=1), end_of_turn_id(tokenizer))
    models = PPOModels(
        policy=build_tiny_model(tokenizer, seed=0),
        reference=build_tiny_model(tokenizer, seed=0),
        critic=Critic.from_reward_model(reward_model),
        scorer=RewardModelScorer(reward_model.requires_grad_(False), micro_batch_size=2),
    )
    reply = tokenizer("Fine, thanks.", add_special_tokens=False)["input_ids"] + [end_of_turn_id(tokenizer)]
    engine = ScriptedEngine(reply, tokenizer.pad_token_id)
    prompts = [[{"role": "user", "content": f"Question {i}?"}] for i in range(8)]
    trainer = PPOTrainer(models, tokenizer, PPOData(prompts, prompts[:2]), config, seed=0, engine=engine)
    policy_before = [p.detach().clone() for p in models.policy.parameters()]
    result = fit(trainer, tmp_path / "run")
    assert result.final_step == 2 and result.stop is None
    # validation at 0 and 2, a rollout per iteration: each generate right after a weight sync
    assert engine.calls == ["sync", "generate"] * 4
    assert result.metrics["rollout/generated_tokens"] == config.rollout_batch_size * len(reply)
    assert "rollout/engine_logprob_gap" not in result.metrics  # this engine reports no log-probs
    assert any(not torch.equal(a, b) for a, b in zip(policy_before, models.policy.parameters()))
