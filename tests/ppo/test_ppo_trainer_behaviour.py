"""Behaviour: PPO-max actually optimises a reward, within a KL bound, and the guard stops collapsing runs.

The policy is a tiny model first taught (a few dozen SFT steps) to answer with a few words drawn from
ten fruit names, then an end-of-turn token. The reward is dense and rule-based: the share of response
tokens that are one of three of those words, which the initial model already emits (share about 0.17:
replies are short, and their end-of-turn token counts too).
Runs of the ppo_max recipe with three seeds must raise the validation reward (which counts the unfinished
penalty) by more than the seed-to-seed spread while the per-token KL stays under the guard's bound, and
hand on the trained policy rather than the start; runs with a low KL bound, a tight length bound and a
tight perplexity bound must each stop with the guard's message, handing on the policy the selection rule
chose among the validated ones.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from rlhf_core.config import PPOConfig
from rlhf_core.models.chat import encode_conversation
from rlhf_core.models.heads import Critic
from rlhf_core.models.tiny import build_tiny_model
from rlhf_core.ppo.experience_maker import PPOModels
from rlhf_core.ppo.ptx import collate_ptx, ptx_nll_sum
from rlhf_core.ppo.trainer import FitResult, PPOData, PPOTrainer, fit
from rlhf_core.ppo.validation import BEST_DIR
from rlhf_core.training.logger import JsonlLogger

pytestmark = pytest.mark.usefixtures("one_thread")

WORDS = [" apple", " banana", " cherry", " grape", " lemon", " mango", " peach", " plum", " kiwi", " yes"]
REWARDED = WORDS[:3]
PROMPTS = [[{"role": "user", "content": f"List some fruit, please ({i})."}] for i in range(48)]
EVAL_PROMPTS = [[{"role": "user", "content": f"Which fruit do you like? ({i})"}] for i in range(32)]
SEEDS = (0, 1, 2)
KL_BOUND = 0.5
NO_BOUNDS = {"max_kl": None, "min_length_ratio": None, "max_length_ratio": None, "max_perplexity_drop": None}


class TokenRuleScorer:
    """Dense rule reward on the rewarded words: their share of each response's real tokens or, with
    `count=True`, their number (which also pays for longer responses)."""

    def __init__(self, token_ids: list[int], count: bool = False) -> None:
        self.token_ids = torch.tensor(token_ids)
        self.count = count

    def __call__(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        response_ids: torch.Tensor,
        response_mask: torch.Tensor,
    ) -> torch.Tensor:
        hits = (torch.isin(response_ids, self.token_ids) & response_mask.bool()).sum(dim=1).float()
        return hits if self.count else hits / response_mask.sum(dim=1).float()


def fruit_reply(rng: random.Random) -> str:
    return "".join(rng.choice(WORDS) for _ in range(rng.randint(2, 8)))


@pytest.fixture(scope="module")
def sft_corpus() -> list[tuple[list[dict[str, str]], str]]:
    rng = random.Random(0)
    return [(PROMPTS[i % len(PROMPTS)], fruit_reply(rng)) for i in range(256)]


@pytest.fixture(scope="module")
def sft_state(tokenizer: PreTrainedTokenizerBase, sft_corpus: list) -> dict[str, torch.Tensor]:
    """Weights of the tiny model after a short SFT on the fruit replies (the loss ends near ln 10)."""
    model = build_tiny_model(tokenizer, seed=0)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    rng = random.Random(1)
    for _ in range(30):
        examples = [encode_conversation(tokenizer, prompt, reply) for prompt, reply in rng.sample(sft_corpus, 16)]
        batch = collate_ptx(examples, tokenizer.pad_token_id, torch.device("cpu"))
        loss = ptx_nll_sum(model, batch) / batch.loss_mask[:, 1:].sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert loss.item() < 3.0
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def sft_model(tokenizer: PreTrainedTokenizerBase, state: dict[str, torch.Tensor]) -> PreTrainedModel:
    model = build_tiny_model(tokenizer, seed=0)
    model.load_state_dict(state)
    return model


def run(
    tokenizer: PreTrainedTokenizerBase,
    state: dict,
    corpus: list,
    out: Path,
    seed: int,
    count: bool = False,
    **settings: Any,
) -> tuple[FitResult, list[dict[str, float]]]:
    """A PPO-max run (the ppo_max preset; critic from the SFT model) against the fruit reward."""
    config = PPOConfig(
        **{
            "steps": 8,
            "critic_pretrain_steps": 2,
            "rollout_batch_size": 16,
            "mini_batch_size": 8,
            "micro_batch_size": 8,
            "ppo_epochs": 2,
            "policy_lr": 1e-3,
            "critic_lr": 1e-3,
            "max_prompt_tokens": 64,
            "val_prompts": len(EVAL_PROMPTS),
            "trainable_top_layers": None,
            "eval_every": 100,
            "checkpoint_every": 100,
            "keep_checkpoints": 100,
            "rollout": {"max_new_tokens": 8},
            **settings,
        }
    )
    reward = TokenRuleScorer([tokenizer(word, add_special_tokens=False)["input_ids"][0] for word in REWARDED], count)
    models = PPOModels(
        policy=sft_model(tokenizer, state),
        reference=sft_model(tokenizer, state),
        critic=Critic.from_causal_lm(sft_model(tokenizer, state), seed=seed),
        scorer=reward,
    )
    trainer = PPOTrainer(models, tokenizer, PPOData(PROMPTS, EVAL_PROMPTS, corpus), config, seed=seed)
    logger = JsonlLogger(out / "history.jsonl")
    result = fit(trainer, out / "checkpoints", logger)
    logger.close()
    return result, [json.loads(line) for line in (out / "history.jsonl").read_text().splitlines()]


def test_ppo_max_raises_the_reward_beyond_seed_noise_within_the_kl_bound(
    tokenizer: PreTrainedTokenizerBase, sft_state: dict, sft_corpus: list, tmp_path: Path
) -> None:
    initial, final = [], []
    for seed in SEEDS:
        result, history = run(
            tokenizer, sft_state, sft_corpus, tmp_path / f"seed-{seed}", seed, guard={**NO_BOUNDS, "max_kl": KL_BOUND}
        )
        assert result.stop is None, result.stop
        assert max(row["kl/token_k3"] for row in history if "kl/token_k3" in row) < KL_BOUND
        validations = [row for row in history if "val/reward" in row]
        assert [row["step"] for row in validations] == [0, 10]
        assert result.selection.step == 10  # the run hands on the trained policy, not the start
        initial.append(validations[0]["val/reward"])
        final.append(validations[-1]["val/reward"])
    gain = sum(final) / len(final) - sum(initial) / len(initial)
    spread = max(max(final) - min(final), max(initial) - min(initial))
    assert gain > spread, f"reward {initial} -> {final}: gain {gain:.3f} is within the seed spread {spread:.3f}"


def policy_weights(path: Path) -> dict[str, torch.Tensor]:
    """Policy tensors of a checkpoint's model.safetensors (prefix "policy.") or of a saved causal LM.

    The tied embedding / LM head matrix is stored once, under either name; it is returned under
    "model.embed_tokens.weight".
    """
    tensors = load_file(path)
    if any(name.startswith("policy.") for name in tensors):
        tensors = {name.removeprefix("policy."): t for name, t in tensors.items() if name.startswith("policy.")}
    if "model.embed_tokens.weight" not in tensors:
        tensors["model.embed_tokens.weight"] = tensors["lm_head.weight"]
    tensors.pop("lm_head.weight", None)
    return tensors


def reference_selection(result: FitResult, max_kl: float | None) -> int:
    """The selection rule in plain Python: the latest validation within the KL bound, unless an earlier
    one beats it by more than two paired standard errors (then the one that beats it by the most)."""
    within = [record for record in result.validations if max_kl is None or record.kl <= max_kl]
    latest, chosen, margin = within[-1], within[-1].step, 0.0
    for record in within[:-1]:
        differences = [a - b for a, b in zip(record.rewards, latest.rewards)]
        mean = sum(differences) / len(differences)
        se = (sum((d - mean) ** 2 for d in differences) / (len(differences) - 1) / len(differences)) ** 0.5
        if mean > 2 * se and mean > margin:
            chosen, margin = record.step, mean
    return chosen


@pytest.mark.parametrize(
    ("bound", "guard", "count"),
    [
        ("max_kl", {**NO_BOUNDS, "max_kl": 0.05}, False),
        # paying per rewarded word makes the policy talk longer
        ("max_length_ratio", {**NO_BOUNDS, "max_length_ratio": 1.4}, True),
        ("max_perplexity_drop", {**NO_BOUNDS, "max_perplexity_drop": 0.15}, False),
    ],
)
def test_guard_stops_the_run_and_the_best_checkpoint_is_handed_on(
    tokenizer: PreTrainedTokenizerBase,
    sft_state: dict,
    sft_corpus: list,
    tmp_path: Path,
    bound: str,
    guard: dict,
    count: bool,
) -> None:
    result, history = run(
        tokenizer,
        sft_state,
        sft_corpus,
        tmp_path,
        seed=0,
        count=count,
        guard=guard,
        policy_lr=3e-3,
        eval_every=1,
        val_prompts=8,
        checkpoint_every=1,
    )
    assert result.stop is not None and result.stop.bound == bound
    assert f"collapse guard stopped the run at step {result.stop.step}: " in str(result.stop)
    assert history[-1]["step"] == result.stop.step and history[-1]["guard/stopped"] == 1.0
    assert result.final_step == result.stop.step - 1 and result.stop.step > 3  # after the policy moved
    chosen = reference_selection(result, guard["max_kl"])
    assert result.selection.step == chosen
    assert [record.step for record in result.validations] == [row["step"] for row in history if "val/reward" in row]
    saved = policy_weights(tmp_path / "checkpoints" / BEST_DIR / "model.safetensors")
    if chosen == 0:
        expected = {name: t for name, t in sft_state.items() if name != "lm_head.weight"}
    else:
        expected = policy_weights(tmp_path / "checkpoints" / f"step-{chosen:08d}" / "model.safetensors")
    assert saved.keys() == expected.keys() and all(torch.equal(saved[n], expected[n]) for n in saved)
