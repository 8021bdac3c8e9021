"""LoRA adapters (rlhf_core/models/lora.py) and bf16 frozen models in PPO.

Units on tiny models: only adapters and scalar heads train; after a few training steps that moved the
adapters, the merged (plain) copy gives the same logits, scores and values as the adapter model.
Stages on configs/tiny.yaml with LoRA on: SFT -> reward model -> PPO each write a plain Hugging Face
model; a run interrupted after its step-2 checkpoint and rerun ends with exactly the weights of an
uninterrupted run. PPO with its reference and reward models in bf16 runs, and their log-probs and scores
stay close to fp32.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from peft.tuners.lora import LoraLayer
from safetensors.torch import load_file, load_model
from torch import Tensor, nn
from transformers import AutoModelForCausalLM

from fixtures.parameters import trainable_names
from fixtures.tiny_ppo import StageInputs, tiny_config
from rlhf_core.config import ConfigError, LoraConfig
from rlhf_core.models.chat import end_of_turn_id
from rlhf_core.models.heads import Critic, RewardModel
from rlhf_core.models.lora import adapted_layer_names, has_lora_adapters, make_trainable, merged_for_export
from rlhf_core.models.saving import save_causal_lm
from rlhf_core.models.tiny import load_tiny_model
from rlhf_core.ppo.scoring import RewardModelScorer
from rlhf_core.ppo.trainer import PPOTrainer
from rlhf_core.stages.ppo import load_ppo_data, load_ppo_models, run_ppo
from rlhf_core.stages.reward import run_train_rm
from rlhf_core.stages.sft import run_sft

pytestmark = pytest.mark.usefixtures("one_thread")

# Fixed and small so the adapters move visibly in three steps; dropout > 0 so merging must ignore it.
LORA = LoraConfig(enabled=True, r=4, alpha=8.0, dropout=0.1)
MERGE_TOLERANCE = 1e-5
# bf16 keeps 8 significant bits. Measured on these tiny random models (seeded, so deterministic): the
# reference's per-token log-probs (about -10.8 nats) move by at most 0.0018 nats, the reward model's
# scores (about -2 to 2) by at most 0.019. The bounds leave 10x and 2.5x room.
BF16_LOGPROB_TOLERANCE = 0.02
BF16_SCORE_TOLERANCE = 0.05


# --------------------------------------------------------------------------------------------------
# helpers


def token_batch(seed: int, vocab: int, rows: int = 3, width: int = 12) -> tuple[Tensor, Tensor]:
    """Random token ids [rows, width] with the last two tokens of row 0 padded (mask 0)."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows, width), generator=generator)
    mask = torch.ones_like(ids)
    mask[0, -2:] = 0
    return ids, mask


def train_a_few_steps(model: nn.Module, loss_of: Callable[[nn.Module], Tensor], steps: int = 3) -> None:
    """AdamW steps on the trainable parameters, in train mode (so LoRA dropout is active)."""
    torch.manual_seed(0)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.train()
    for _ in range(steps):
        optimizer.zero_grad()
        loss_of(model).backward()
        optimizer.step()
    model.eval()


def adapter_names(model: nn.Module) -> set[str]:
    return {name for name, _ in model.named_parameters() if ".lora_A." in name or ".lora_B." in name}


def assert_adapters_moved(model: nn.Module) -> None:
    """B starts at zero: a nonzero B means training changed what the adapter adds."""
    lora_b = [p for name, p in model.named_parameters() if ".lora_B." in name]
    assert lora_b and all(p.abs().max() > 1e-4 for p in lora_b)


def assert_plain_state(directory: Path, expected_keys: set[str]) -> None:
    """A saved model directory holds exactly the plain parameter names, nothing of peft's."""
    keys = set(load_file(directory / "model.safetensors"))
    assert keys == expected_keys
    assert not (directory / "adapter_config.json").exists()


# --------------------------------------------------------------------------------------------------
# units: what trains, and merged == adapters


def test_only_adapters_and_scalar_heads_require_grad() -> None:
    lm, tokenizer = load_tiny_model()
    make_trainable(lm, None, LORA, seed=0)
    assert trainable_names(lm) == adapter_names(lm) and len(adapter_names(lm)) == 2 * 2 * 7  # A, B x 2 x 7

    reward_model = RewardModel.from_causal_lm(load_tiny_model()[0], end_of_turn_id(tokenizer), keep_lm_head=True)
    make_trainable(reward_model, None, LORA, seed=0, heads=[reward_model.score_head])
    assert trainable_names(reward_model) == adapter_names(reward_model) | {"score_head.weight", "score_head.bias"}
    assert reward_model.lm_head is not None and not reward_model.lm_head.weight.requires_grad  # tied, frozen

    critic = Critic.from_causal_lm(load_tiny_model()[0])
    make_trainable(critic, None, LORA, seed=0, heads=[critic.value_head])
    assert trainable_names(critic) == adapter_names(critic) | {"value_head.weight", "value_head.bias"}


def test_trainable_top_layers_puts_adapters_into_the_top_blocks_only() -> None:
    lm, _ = load_tiny_model()
    names = adapted_layer_names(lm, ["q_proj", "down_proj"], top_layers=1)
    assert names == ["model.layers.1.self_attn.q_proj", "model.layers.1.mlp.down_proj"]
    make_trainable(lm, 1, LoraConfig(enabled=True, target_modules=("q_proj", "down_proj")), seed=0)
    adapted = [name for name, module in lm.named_modules() if isinstance(module, LoraLayer)]
    assert adapted == names
    assert all(".layers.1." in name for name in trainable_names(lm))
    assert not lm.model.norm.weight.requires_grad  # unlike plain top-layer training, the norm stays frozen


def test_adapter_initialisation_is_seeded_and_leaves_the_global_random_state_alone() -> None:
    first, second = load_tiny_model()[0], load_tiny_model()[0]
    state = torch.get_rng_state()
    make_trainable(first, None, LORA, seed=3)
    assert torch.equal(torch.get_rng_state(), state)
    make_trainable(second, None, LORA, seed=3)
    for (name, a), b in zip(first.state_dict().items(), second.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_merged_language_model_gives_the_adapter_models_logits(tmp_path: Path) -> None:
    lm, tokenizer = load_tiny_model()
    base_keys = set(lm.state_dict())
    base_logits = lm(*token_batch(0, 1000)).logits
    make_trainable(lm, None, LORA, seed=0)
    ids, mask = token_batch(1, 1000)
    train_a_few_steps(lm, lambda m: m(input_ids=ids, attention_mask=mask, labels=ids).loss)
    assert_adapters_moved(lm)

    with torch.no_grad():
        adapter_logits = lm(*token_batch(0, 1000)).logits
        merged = merged_for_export(lm)
        merged_logits = merged(*token_batch(0, 1000)).logits
    assert not has_lora_adapters(merged) and has_lora_adapters(lm)  # the trained model keeps its adapters
    assert (adapter_logits - base_logits).abs().max() > 1e-3  # training changed the model
    torch.testing.assert_close(merged_logits, adapter_logits, rtol=0, atol=MERGE_TOLERANCE)

    save_causal_lm(lm, tokenizer, tmp_path / "model")
    assert_plain_state(tmp_path / "model", {key for key in base_keys if key != "lm_head.weight"})  # tied
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    with torch.no_grad():
        loaded_logits = loaded(*token_batch(0, 1000)).logits
    torch.testing.assert_close(loaded_logits, adapter_logits, rtol=0, atol=MERGE_TOLERANCE)


def test_merged_reward_model_and_critic_give_the_adapter_models_outputs(tmp_path: Path) -> None:
    _, tokenizer = load_tiny_model()
    eot = end_of_turn_id(tokenizer)
    reward_model = RewardModel.from_causal_lm(load_tiny_model(seed=1)[0], eot)
    base_keys = set(reward_model.backbone.state_dict())
    make_trainable(reward_model, None, LORA, seed=0, heads=[reward_model.score_head])
    ids, mask = token_batch(2, 1000)
    train_a_few_steps(reward_model, lambda m: -m(ids, mask, reply_start=4).scores.std())
    assert_adapters_moved(reward_model)
    critic = Critic.from_reward_model(reward_model)  # a copy, adapters included
    train_a_few_steps(critic, lambda m: (m(ids, mask) - 1.0).pow(2).mean())

    with torch.no_grad():
        scores = reward_model(*token_batch(0, 1000), reply_start=4).scores
        values = critic(*token_batch(0, 1000))
        reward_model.save_pretrained(tmp_path / "reward", tokenizer)
        critic.save_pretrained(tmp_path / "critic", tokenizer)
        loaded_scores = RewardModel.from_pretrained(tmp_path / "reward")(*token_batch(0, 1000), reply_start=4)
        loaded_values = Critic.from_pretrained(tmp_path / "critic")(*token_batch(0, 1000))
    assert has_lora_adapters(reward_model) and has_lora_adapters(critic)
    assert_plain_state(tmp_path / "reward", base_keys)
    assert_plain_state(tmp_path / "critic", base_keys)
    assert not torch.allclose(values, Critic.from_pretrained(tmp_path / "reward")(*token_batch(0, 1000)))
    torch.testing.assert_close(loaded_scores.scores, scores, rtol=0, atol=MERGE_TOLERANCE)
    torch.testing.assert_close(loaded_values, values, rtol=0, atol=MERGE_TOLERANCE)


def test_unknown_target_module_and_bad_block_count_are_named() -> None:
    lm, _ = load_tiny_model()
    with pytest.raises(ValueError, match=r"lora.target_modules \['qproj'\] match no Linear.*'q_proj'"):
        make_trainable(lm, None, LoraConfig(enabled=True, target_modules=("q_proj", "qproj")), seed=0)
    with pytest.raises(ValueError, match=r"trainable_top_layers must be in \[1, 2\].*got 3"):
        make_trainable(lm, 3, LORA, seed=0)
    assert not has_lora_adapters(lm)  # nothing injected by a refused call


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("sft.lora.r=0", "sft.lora.r: Input should be greater than or equal to 1"),
        ("reward.lora.alpha=0", "reward.lora.alpha: Input should be greater than 0"),
        ("ppo.lora.dropout=1.0", "ppo.lora.dropout: Input should be less than 1"),
        ("ppo.lora.target_modules=[]", "ppo.lora.target_modules: .*at least 1 item"),
        ("sft.lora.target_modules=[q_proj, q_proj]", "sft.lora.target_modules: a layer name is listed twice"),
        ("sft.lora.target_modules=[model.q_proj]", "sft.lora.target_modules: expected plain layer names"),
        ("ppo.lora.rank=8", "ppo.lora.rank: unknown key; allowed keys here: alpha, dropout, enabled, r, "),
        ("ppo.frozen_models_dtype=float16", "ppo.frozen_models_dtype: Input should be 'float32' or 'bfloat16'"),
    ],
)
def test_config_errors_name_the_key(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        tiny_config(override)


def test_defaults_are_off() -> None:
    config = tiny_config()
    assert not (config.sft.lora.enabled or config.reward.lora.enabled or config.ppo.lora.enabled)
    assert config.ppo.frozen_models_dtype is None


# --------------------------------------------------------------------------------------------------
# stages with LoRA on: SFT -> reward model -> PPO, each on the previous one's output


class CrashAtStep:
    """A caller's logger that raises at `step`: the run dies after its last checkpoint before it."""

    def __init__(self, step: int) -> None:
        self.step = step

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if step == self.step:
            raise RuntimeError(f"crash at step {step}")

    def log_params(self, params: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


SFT_LORA = ("sft.lora.enabled=true",)
RM_LORA = ("reward.lora.enabled=true", "reward.trainable_top_layers=1")  # adapters in block 1 only
PPO_LORA = ("ppo.lora.enabled=true",)


@pytest.fixture(scope="module")
def pipeline(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> StageInputs:
    """Uninterrupted LoRA runs of SFT, the reward model (from that SFT) and PPO (from both)."""
    root = tmp_path_factory.mktemp("lora")
    run_sft(tiny_config(*SFT_LORA), data_dir, root / "sft")
    run_train_rm(tiny_config(*RM_LORA), data_dir, root / "sft", root / "reward")
    run_ppo(tiny_config(*PPO_LORA), data_dir, root / "sft", root / "reward", root / "ppo")
    return StageInputs(data_dir=data_dir, sft_dir=root / "sft", rm_dir=root / "reward")


def plain_lm_keys() -> set[str]:
    return {key for key in load_tiny_model()[0].state_dict() if key != "lm_head.weight"}  # tied


def test_sft_with_lora_saves_the_merged_final_checkpoint(pipeline: StageInputs) -> None:
    model_dir = pipeline.sft_dir / "model"
    assert_plain_state(model_dir, plain_lm_keys())
    saved = AutoModelForCausalLM.from_pretrained(model_dir)
    assert not has_lora_adapters(saved)
    # The final checkpoint holds the adapters: load it into a freshly adapted base model.
    adapted = load_tiny_model()[0]
    make_trainable(adapted, None, tiny_config(*SFT_LORA).sft.lora, seed=0)
    load_model(adapted, str(pipeline.sft_dir / "checkpoints" / "step-00000004" / "model.safetensors"))
    assert_adapters_moved(adapted)
    with torch.no_grad():
        torch.testing.assert_close(
            saved(*token_batch(0, 1000)).logits,
            adapted.eval()(*token_batch(0, 1000)).logits,
            rtol=0,
            atol=MERGE_TOLERANCE,
        )


def test_reward_model_with_lora_in_the_top_block_keeps_the_lower_block(pipeline: StageInputs) -> None:
    model_dir = pipeline.rm_dir / "model"
    sft_backbone = AutoModelForCausalLM.from_pretrained(pipeline.sft_dir / "model").model.state_dict()
    assert_plain_state(model_dir, set(sft_backbone))
    reward_model = RewardModel.from_pretrained(model_dir)
    for name, tensor in reward_model.backbone.state_dict().items():
        if name.startswith("layers.1.") and name.endswith("proj.weight"):
            assert not torch.equal(tensor, sft_backbone[name]), name  # adapted and merged
        else:  # embeddings, block 0, norms: frozen base weights
            assert torch.equal(tensor, sft_backbone[name]), name


def test_ppo_with_lora_writes_a_plain_policy(pipeline: StageInputs) -> None:
    ppo_dir = pipeline.sft_dir.parent / "ppo"
    assert (ppo_dir / "metrics.json").is_file()
    assert_plain_state(ppo_dir / "model", plain_lm_keys())
    policy = AutoModelForCausalLM.from_pretrained(ppo_dir / "model")
    assert not has_lora_adapters(policy)
    checkpoint = load_file(ppo_dir / "checkpoints" / "step-00000004" / "model.safetensors")
    assert any(".lora_B." in key for key in checkpoint) and any(
        key.startswith("critic.") and ".lora_B." in key for key in checkpoint
    )


def assert_same_weights(first: Path, second: Path) -> None:
    a, b = load_file(first), load_file(second)
    assert a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a), first


def test_sft_resumed_with_adapters_matches_the_uninterrupted_run(pipeline: StageInputs, tmp_path: Path) -> None:
    out = tmp_path / "sft"
    with pytest.raises(RuntimeError, match="crash at step 3"):
        run_sft(tiny_config(*SFT_LORA), pipeline.data_dir, out, logger=CrashAtStep(3))
    assert not (out / "metrics.json").exists()
    assert run_sft(tiny_config(*SFT_LORA), pipeline.data_dir, out).metrics["resumed_from"] == 2
    for relative in ("model/model.safetensors", "checkpoints/step-00000004/model.safetensors"):
        assert_same_weights(pipeline.sft_dir / relative, out / relative)


def test_ppo_resumed_with_adapters_matches_the_uninterrupted_run(pipeline: StageInputs, tmp_path: Path) -> None:
    out = tmp_path / "ppo"
    config = tiny_config(*PPO_LORA)
    with pytest.raises(RuntimeError, match="crash at step 3"):
        run_ppo(config, pipeline.data_dir, pipeline.sft_dir, pipeline.rm_dir, out, logger=CrashAtStep(3))
    assert not (out / "metrics.json").exists()
    assert run_ppo(config, pipeline.data_dir, pipeline.sft_dir, pipeline.rm_dir, out).metrics["resumed_from"] == 2
    uninterrupted = pipeline.sft_dir.parent / "ppo"
    for relative in ("model/model.safetensors", "checkpoints/step-00000004/model.safetensors"):
        assert_same_weights(uninterrupted / relative, out / relative)


# --------------------------------------------------------------------------------------------------
# PPO with the frozen reference and reward models in bf16


def dtypes(model: nn.Module) -> set[torch.dtype]:
    return {parameter.dtype for parameter in model.parameters()}


def test_frozen_models_in_bf16_stay_close_to_fp32_and_the_ppo_step_runs(inputs: StageInputs) -> None:
    cpu = torch.device("cpu")
    trainers = {}
    for dtype in ("float32", "bfloat16"):
        config = tiny_config(f"ppo.frozen_models_dtype={dtype}")
        models, tokenizer = load_ppo_models(config, inputs.sft_dir, inputs.rm_dir, cpu)
        trainers[dtype] = PPOTrainer(models, tokenizer, load_ppo_data(config, inputs.data_dir), config.ppo, 0)
    models = trainers["bfloat16"].models
    assert isinstance(models.scorer, RewardModelScorer)
    assert dtypes(models.reference) == dtypes(models.scorer.reward_model) == {torch.bfloat16}
    assert dtypes(models.policy) == dtypes(models.critic) == {torch.float32}  # trained: model.dtype

    experiences = {}
    for dtype, trainer in trainers.items():
        torch.manual_seed(5)  # the same sampled responses: generation uses only the fp32 policy
        experiences[dtype], _ = trainer.maker.make_experience(trainer.maker.next_prompts())
    full, half = experiences["float32"], experiences["bfloat16"]
    assert torch.equal(full.response_ids, half.response_ids) and torch.equal(full.logprobs, half.logprobs)
    real = full.response_mask.bool()
    assert half.ref_logprobs.dtype == torch.float32
    logprob_error = (half.ref_logprobs - full.ref_logprobs)[real].abs().max()
    score_error = (half.scores - full.scores).abs().max()
    assert 0 < logprob_error < BF16_LOGPROB_TOLERANCE, logprob_error
    assert score_error < BF16_SCORE_TOLERANCE, score_error

    trainer = trainers["bfloat16"]
    for step in range(1, trainer.config.critic_pretrain_steps + 1):  # critic pretraining, to its cap
        trainer.learn(half, step)
    metrics = trainer.learn(half, trainer.config.critic_pretrain_steps + 1)  # trains the policy too
    assert all(torch.isfinite(torch.tensor(value)) for value in metrics.values())
    assert metrics["policy/grad_norm"] > 0
