"""The promotion gate's controls on the tiny model (issue 27): shortening cannot pass it, real gains can.

Every control builds the evaluation's figures as the eval stage does (stages/evaluate.py): both models
answer the evaluation prompts of prepared data (`generate_replies`, the evaluation's sampling settings),
their perplexity on the prompts' held-out chosen replies gives the alignment tax (`reply_perplexity`), the
pairs go through generations.jsonl, a judge gives its verdicts, and `build_report(...).metrics()` gives
metrics.json's figures, which `gate_checks` reads with the PPO run's figures.

The policies are the tiny SFT model moved the simplest way PPO could move it: its output layer given a
bias on some tokens' logits (`tilted`). The judges are rules, so what they pay for is known:
- negative control 1, "SFT replies cut to the PPO reply lengths": model A answers with the SFT replies
  cut to the lengths of a collapsed policy's replies, judged by a judge whose score falls with length (the
  issue's reward model, made plain): A wins nearly every pair and the plain win-minus-loss check passes,
  and the gate must still fail it, on the length ratio at least (the length-controlled win rate has few
  pairs of similar length to go on, so its interval is wide);
- negative control 2, "a collapsed run with the guard off": a policy whose end-of-turn token was made
  likely (short replies), its PPO run with every guard bound null and a KL within the bound (the issue's
  collapse that stays under KL 0.3): the gate must fail it, the guard shown as disabled;
- positive control, "a genuinely better policy": a policy moved toward the words of the preferred replies
  of the training data, judged by a dense rule that is not length (the share of a reply's tokens that are
  such words): replies of the SFT model's length, and the gate must pass it.
The PPO run's figures are given (a run of the default guard, or of none, that the guard did not stop).
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
import torch
from fixtures.tiny_ppo import hh_pair, tiny_config
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from rlhf_core.config import CollapseGuardConfig, Config
from rlhf_core.data.prepare import load_split
from rlhf_core.evaluation.alignment_tax import AlignmentTax, reply_perplexity
from rlhf_core.evaluation.generation import Reply, generate_replies
from rlhf_core.evaluation.judges.reward_model import margin_verdict
from rlhf_core.evaluation.judges.verdicts import EvalPair, JudgeInfo, Judgement
from rlhf_core.evaluation.outputs import generation_rows, read_generations, write_jsonl
from rlhf_core.evaluation.prompts import EvalPrompt, evaluation_prompts
from rlhf_core.evaluation.report import build_report
from rlhf_core.models.chat import end_of_turn_id
from rlhf_core.models.tiny import build_tiny_model
from rlhf_core.stages.evaluate import GENERATIONS_FILE, judged_pairs
from rlhf_core.stages.prepare_data import run_prepare_data
from rlhf_core.promotion.gate import GUARD_DISABLED, gate_checks

pytestmark = pytest.mark.usefixtures("one_thread")

SOURCE_PAIRS = 120
SETTINGS = ("data.max_eval_pairs=null", "data.eval_fraction=0.3", "evaluation.generation.max_new_tokens=24")
COLLAPSE_BIAS = 8.5  # on the end-of-turn logit: about 1 in 10 tokens ends the reply (the random SFT's: 1 in 49k)
PREFERRED_WORDS_BIAS = 5.0  # on the logits of the preferred replies' tokens
BREVITY_JUDGE_NOISE = 4.0  # tokens: the brevity judge's score is minus the length plus this much noise
GUARD_OFF = CollapseGuardConfig(max_kl=None, min_length_ratio=None, max_length_ratio=None, max_perplexity_drop=None)


# ---- the policies and the judges


def tilted(model: PreTrainedModel, token_ids: Sequence[int], bias: float) -> PreTrainedModel:
    """A copy of `model` whose output layer adds `bias` to the logits of `token_ids` (and nothing else)."""
    moved = copy.deepcopy(model)
    head = torch.nn.Linear(moved.lm_head.in_features, moved.lm_head.out_features, bias=True)
    with torch.no_grad():
        head.weight.copy_(moved.lm_head.weight)
        head.bias.zero_()
        head.bias[list(token_ids)] = bias
    moved.lm_head = head
    return moved.eval()


class RuleJudge:
    """A judge that scores each reply by a rule on its tokens; the higher score wins (ties on equal scores)."""

    def __init__(self, name: str, tokenizer: PreTrainedTokenizerBase, score) -> None:
        self.name, self.tokenizer, self.score = name, tokenizer, score

    def judge(self, pairs: Sequence[EvalPair]) -> list[Judgement]:
        judgements = []
        for pair in pairs:
            score_a, score_b = (self.score(self.token_ids(reply)) for reply in (pair.reply_a, pair.reply_b))
            verdict = margin_verdict(score_a - score_b, tie_margin=0.0)
            judgements.append(Judgement(verdict, {"score_a": score_a, "score_b": score_b}))
        return judgements

    def token_ids(self, reply: str) -> list[int]:
        return self.tokenizer(reply, add_special_tokens=False)["input_ids"]

    def info(self) -> JudgeInfo:
        return JudgeInfo(kind="rule", name=self.name, role=f"the rule judge {self.name}", description=f"rule judge: {self.name}")


def brevity_judge(tokenizer: PreTrainedTokenizerBase) -> RuleJudge:
    """A judge whose score falls with length, like the reward model of the issue (reward-length Spearman
    -0.55): minus the reply's token count, plus a fixed noise drawn from the reply's text."""

    def score(ids: list[int]) -> float:
        noise = np.random.default_rng(int(hashlib.sha256(str(ids).encode()).hexdigest()[:8], 16)).normal()
        return -float(len(ids)) + BREVITY_JUDGE_NOISE * noise

    return RuleJudge("shorter is better", tokenizer, score)


def vocabulary_judge(tokenizer: PreTrainedTokenizerBase, preferred: set[int]) -> RuleJudge:
    """A dense rule that is not length: the share of the reply's tokens that are `preferred` tokens."""
    return RuleJudge(
        "share of preferred words", tokenizer, lambda ids: sum(i in preferred for i in ids) / max(len(ids), 1)
    )


# ---- the evaluation, as the eval stage makes it


def answers(
    config: Config, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompts: Sequence[EvalPrompt]
) -> tuple[list[Reply], float]:
    """A model's replies to `prompts` and its perplexity on their held-out chosen replies (the eval stage's
    `model_replies`, for a model in memory)."""
    replies = generate_replies(
        model, tokenizer, [p.prompt for p in prompts], config.evaluation.generation, config.evaluation.batch_size, config.seed
    )
    references = [(prompt.prompt, prompt.reference_reply) for prompt in prompts]
    perplexity, _ = reply_perplexity(model, tokenizer, references, config.sft.max_length, config.sft.micro_batch_size)
    return replies, perplexity


def evaluation_figures(
    config: Config,
    prompts: Sequence[EvalPrompt],
    a: tuple[list[Reply], float],
    b: tuple[list[Reply], float],
    judge: RuleJudge,
    out_dir: Path,
) -> dict[str, float]:
    """metrics.json's figures of model A (replies, perplexity) against model B, judged by `judge`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    write_jsonl(out_dir / GENERATIONS_FILE, generation_rows(prompts, a[0], b[0]))
    generated = read_generations(out_dir / GENERATIONS_FILE)
    pairs = judged_pairs(generated, judge.judge([item.pair for item in generated]))
    tax = AlignmentTax(replies=len(prompts), perplexity_a=a[1], perplexity_b=b[1])
    report = build_report(
        pairs, judge.info(), "A", "B", config.evaluation.generation, config.seed, alignment_tax=tax, resamples=1000
    )
    return report.metrics()


def ppo_run_figures(guard: CollapseGuardConfig, kl: float) -> dict[str, float]:
    """The figures of a PPO run's metrics.json the gate reads, for a run the guard did not stop:
    `guard_enabled` as the PPO stage writes it (stages/ppo.py: `stage_metrics`)."""
    return {"val/kl_best": kl, "guard_enabled": float(guard.enabled), "guard_stopped": 0.0}


GUARDED_RUN = ppo_run_figures(CollapseGuardConfig(), kl=0.12)  # the default guard, not fired; KL within the bound


def cut(replies: Sequence[Reply], lengths: Sequence[int], tokenizer) -> list[Reply]:
    """Each reply cut to the matching length in tokens (a reply already as short stays as it is)."""
    shortened = []
    for reply, length in zip(replies, lengths):
        ids = tokenizer(reply.text, add_special_tokens=False)["input_ids"][:length]
        shortened.append(Reply(text=tokenizer.decode(ids), tokens=len(ids), finished=False))
    return shortened


# ---- the fixtures


class Setting:
    """The prepared data, the configuration, the tokens of the preferred replies of the reward-model training
    split, and the SFT model's answers."""

    def __init__(self, root: Path, tokenizer: PreTrainedTokenizerBase) -> None:
        source = root / "pairs.jsonl"
        source.write_text("".join(json.dumps(hh_pair(i)) + "\n" for i in range(SOURCE_PAIRS)))
        self.config = tiny_config(*SETTINGS)
        run_prepare_data(self.config, root / "data", source=str(source))
        self.prompts = evaluation_prompts(root / "data", None)
        chosen = [pair.chosen for pair in load_split(root / "data", "rm_train")]  # not the evaluation's
        self.preferred = {token for ids in tokenizer(chosen, add_special_tokens=False)["input_ids"] for token in ids}
        self.sft = build_tiny_model(tokenizer, seed=0)
        self.sft_answers = answers(self.config, self.sft, tokenizer, self.prompts)


@pytest.fixture(scope="module")
def setting(tmp_path_factory: pytest.TempPathFactory, tokenizer: PreTrainedTokenizerBase) -> Setting:
    return Setting(tmp_path_factory.mktemp("controls"), tokenizer)


@pytest.fixture(scope="module")
def collapsed_answers(setting: Setting, tokenizer: PreTrainedTokenizerBase) -> tuple[list[Reply], float]:
    """A collapsed policy: its end-of-turn token made likely, so it answers in a few tokens."""
    collapsed = tilted(setting.sft, [end_of_turn_id(tokenizer)], COLLAPSE_BIAS)
    return answers(setting.config, collapsed, tokenizer, setting.prompts)


# ---- the controls


def test_the_setting_is_what_the_controls_need(setting: Setting, collapsed_answers) -> None:
    assert len(setting.prompts) >= 30
    sft_tokens = [reply.tokens for reply in setting.sft_answers[0]]
    collapsed_tokens = [reply.tokens for reply in collapsed_answers[0]]
    assert sum(collapsed_tokens) < 0.5 * sum(sft_tokens)  # the collapse is a real shortening


def test_sft_replies_cut_to_the_collapsed_lengths_fail_the_gate_though_they_win_on_plain_rates(
    setting: Setting, collapsed_answers, tokenizer, tmp_path: Path
) -> None:
    lengths = [reply.tokens for reply in collapsed_answers[0]]
    replies = cut(setting.sft_answers[0], lengths, tokenizer)
    cut_answers = (replies, setting.sft_answers[1])  # the SFT model itself answered: no alignment tax
    evaluation = evaluation_figures(
        setting.config, setting.prompts, cut_answers, setting.sft_answers, brevity_judge(tokenizer), tmp_path
    )
    checks = {check.name: check for check in gate_checks(setting.config.promotion, evaluation, GUARDED_RUN)}
    described = [check.describe() for check in checks.values()]
    assert checks["win_minus_loss_low"].passed, described  # the old gate's figure: the judge prefers them
    assert not checks["length_ratio"].passed and evaluation["length_ratio"] < 0.5, described
    assert not all(check.passed for check in checks.values())
    assert checks["alignment_tax_relative"].passed and checks["no_collapse"].passed  # the length alone fails it


def test_a_collapsed_run_with_the_guard_off_fails_the_gate_shown_as_guard_disabled(
    setting: Setting, collapsed_answers, tokenizer, tmp_path: Path
) -> None:
    evaluation = evaluation_figures(
        setting.config, setting.prompts, collapsed_answers, setting.sft_answers, brevity_judge(tokenizer), tmp_path
    )
    training = ppo_run_figures(GUARD_OFF, kl=0.2)  # under the KL bound: KL alone would not stop it
    checks = {check.name: check for check in gate_checks(setting.config.promotion, evaluation, training)}
    described = [check.describe() for check in checks.values()]
    assert checks["kl_to_reference"].passed and checks["win_minus_loss_low"].passed, described
    assert checks["no_collapse"].describe() == (
        f"no_collapse = {GUARD_DISABLED} (guard_enabled == 1 and guard_stopped == 0): FAIL"
    )
    assert not checks["length_ratio"].passed, described


def test_a_genuinely_better_policy_passes_the_gate(setting: Setting, tokenizer, tmp_path: Path) -> None:
    better = tilted(setting.sft, sorted(setting.preferred), PREFERRED_WORDS_BIAS)
    better_answers = answers(setting.config, better, tokenizer, setting.prompts)
    judge = vocabulary_judge(tokenizer, setting.preferred)
    evaluation = evaluation_figures(
        setting.config, setting.prompts, better_answers, setting.sft_answers, judge, tmp_path
    )
    checks = gate_checks(setting.config.promotion, evaluation, GUARDED_RUN)
    assert [check.name for check in checks if not check.passed] == [], [check.describe() for check in checks]
    assert evaluation["lc_win_rate_low"] > 0.5 and 0.67 <= evaluation["length_ratio"] <= 1.5
