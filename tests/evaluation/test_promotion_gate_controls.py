"""The promotion gate's controls on the tiny model: shortening cannot pass it, real gains can.

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
  such words): the gate must pass it (below, against the baseline with spread lengths, as long as it
  answers, and its replies cut or padded).
The PPO run's figures are given (a run of the default guard, or of none, that the guard did not stop).
The edges of the length-controlled win rate (slow; the same edges on synthetic verdicts are fast tests in
test_eval_length_control.py), with the eval stage's anchor rows (the baseline's i-th reply against its
(i+1)-th): the baseline is the tiny SFT model with its end-of-turn token made likelier (`BASELINE_EOT_BIAS`),
so its replies vary in length below the cap; each model answers every prompt `SAMPLES` times (A's i-th
reply against B's i-th, as the stage pairs them):
- the baseline's replies cut to 0.75 and 0.9 of their length (inside the length band), judged by the
  shorter-is-better judge, and padded to 1.3x (their own first tokens again), judged by a longer-is-better
  one, must fail the gate on the length-controlled check;
- the better policy (a little longer than the baseline as it answers), its replies as they are and cut to
  0.7 (shorter than the baseline's; cutting hardly changes the share of preferred words), must pass it.
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from fixtures.tiny_ppo import hh_pair, tiny_config
from rlhf_core.config import CollapseGuardConfig, Config, EvaluationConfig
from rlhf_core.data.prepare import load_split
from rlhf_core.evaluation.alignment_tax import AlignmentTax, reply_perplexity
from rlhf_core.evaluation.generation import Reply
from rlhf_core.evaluation.judged_pairs import judged_pairs
from rlhf_core.evaluation.judges.reward_model import margin_verdict
from rlhf_core.evaluation.judges.verdicts import EvalPair, JudgeInfo, Judgement
from rlhf_core.evaluation.outputs import (
    anchor_generation_rows,
    generation_rows,
    read_generations,
    sample_generation_rows,
    write_jsonl,
)
from rlhf_core.evaluation.prompts import EvalPrompt, evaluation_prompts
from rlhf_core.evaluation.report import JudgedPair, build_report
from rlhf_core.models.chat import end_of_turn_id
from rlhf_core.models.tiny import build_tiny_model
from rlhf_core.promotion.gate import GUARD_DISABLED, NO_COLLAPSE_BOUND, gate_checks
from rlhf_core.stages.evaluate import GENERATIONS_FILE, extra_replies, main_replies
from rlhf_core.stages.prepare_data import run_prepare_data

pytestmark = pytest.mark.usefixtures("one_thread")

SOURCE_PAIRS = 120
DEFAULT_EVALUATION = EvaluationConfig()  # the default thresholds of the anchored fit, not tiny.yaml's
SAMPLES = 4  # replies per prompt and model (evaluation.length_matched_samples)
SETTINGS = (
    "data.max_eval_pairs=null",
    "data.eval_fraction=0.3",
    "evaluation.generation.max_new_tokens=24",
    f"evaluation.length_matched_samples={SAMPLES}",
    f"evaluation.min_anchor_pairs={DEFAULT_EVALUATION.min_anchor_pairs}",
    f"evaluation.min_informative_pairs={DEFAULT_EVALUATION.min_informative_pairs}",
)
COLLAPSE_BIAS = 8.5  # on the end-of-turn logit: about 1 in 10 tokens ends the reply (the random SFT's: 1 in 49k)
BASELINE_EOT_BIAS = 7.5  # about 1 in 27 tokens ends the reply: lengths spread below the 24-token cap
PREFERRED_WORDS_BIAS = 5.0  # on the logits of the preferred replies' tokens
BREVITY_JUDGE_NOISE = 4.0  # tokens: the brevity judge's score is minus the length plus this much noise
SHARP_JUDGE_NOISE = 1.0  # tokens: the length judges of the baseline's replies, a few tokens apart, decide on length
GUARD_OFF = CollapseGuardConfig(max_kl=None, min_length_ratio=None, max_length_ratio=None, max_perplexity_drop=None)


# ---- the policies and the judges


def tilted(model: PreTrainedModel, biases: Mapping[int, float]) -> PreTrainedModel:
    """A copy of `model` whose output layer adds `biases[token]` to each token's logit (and nothing else)."""
    moved = copy.deepcopy(model)
    head = torch.nn.Linear(moved.lm_head.in_features, moved.lm_head.out_features, bias=True)
    with torch.no_grad():
        head.weight.copy_(moved.lm_head.weight)
        head.bias.zero_()
        head.bias[list(biases)] = torch.tensor(list(biases.values()), dtype=head.bias.dtype)
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
        return JudgeInfo(
            kind="rule", name=self.name, role=f"the rule judge {self.name}", description=f"rule judge: {self.name}"
        )


def brevity_judge(tokenizer: PreTrainedTokenizerBase, noise_tokens: float = BREVITY_JUDGE_NOISE) -> RuleJudge:
    """A judge whose score falls with length, like the reward model of the issue (reward-length Spearman
    -0.55): minus the reply's token count, plus a fixed noise drawn from the reply's text."""

    def score(ids: list[int]) -> float:
        noise = np.random.default_rng(int(hashlib.sha256(str(ids).encode()).hexdigest()[:8], 16)).normal()
        return -float(len(ids)) + noise_tokens * noise

    return RuleJudge("shorter is better", tokenizer, score)


def verbosity_judge(tokenizer: PreTrainedTokenizerBase) -> RuleJudge:
    """The sharp brevity judge turned round: its score rises with length."""
    brevity = brevity_judge(tokenizer, SHARP_JUDGE_NOISE).score
    return RuleJudge("longer is better", tokenizer, lambda ids: -brevity(ids))


def vocabulary_judge(tokenizer: PreTrainedTokenizerBase, preferred: set[int]) -> RuleJudge:
    """A dense rule that is not length: the share of the reply's tokens that are `preferred` tokens."""
    return RuleJudge(
        "share of preferred words", tokenizer, lambda ids: sum(i in preferred for i in ids) / max(len(ids), 1)
    )


# ---- the evaluation, as the eval stage makes it


def answers(
    config: Config, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompts: Sequence[EvalPrompt]
) -> tuple[list[Reply], float]:
    """A model's main reply to each prompt and its perplexity on their held-out chosen replies (the eval
    stage's `sample_model_replies` without the length-matched samples, for a model in memory)."""
    references = [(prompt.prompt, prompt.reference_reply) for prompt in prompts]
    perplexity, _ = reply_perplexity(model, tokenizer, references, config.sft.max_length, config.sft.micro_batch_size)
    return main_replies(config, model, tokenizer, prompts), perplexity


def one_each(answers: tuple[list[Reply], float]) -> tuple[list[list[Reply]], float]:
    """One reply per prompt (no anchor rows: the length-controlled win rate is not identifiable)."""
    return [[reply] for reply in answers[0]], answers[1]


def sampled_answers(
    config: Config, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompts: Sequence[EvalPrompt]
) -> tuple[list[list[Reply]], float]:
    """A model's `SAMPLES` replies to each prompt, the main one first, as the eval stage draws them, and its
    perplexity on the prompts' held-out chosen replies."""
    main, perplexity = answers(config, model, tokenizer, prompts)
    extra = extra_replies(config, model, tokenizer, prompts)
    return [[first, *others] for first, others in zip(main, extra, strict=True)], perplexity


def judged(rows: list[dict], judge: RuleJudge, path: Path) -> list[JudgedPair]:
    """The pairs of generations.jsonl-style `rows`, written to `path`, read back and judged."""
    write_jsonl(path, rows)
    generated = read_generations(path)
    return judged_pairs(generated, judge.judge([item.pair for item in generated]))


def by_prompt(
    prompts: Sequence[EvalPrompt], pairs: Sequence[JudgedPair], rows: Sequence[dict]
) -> list[list[JudgedPair]]:
    """`pairs` (of `rows`) grouped by prompt, in the prompts' order."""
    groups: dict[str, list[JudgedPair]] = {prompt.prompt_id: [] for prompt in prompts}
    for pair, row in zip(pairs, rows, strict=True):
        groups[row["prompt_id"]].append(pair)
    return list(groups.values())


def evaluation_figures(
    config: Config,
    prompts: Sequence[EvalPrompt],
    a: tuple[list[list[Reply]], float],
    b: tuple[list[list[Reply]], float],
    judge: RuleJudge,
    out_dir: Path,
) -> dict[str, float]:
    """metrics.json's figures of model A (replies per prompt, the main one first; perplexity) against model
    B, judged by `judge`: the main pairs, A's i-th reply against B's i-th for the length-controlled win
    rate, and B's replies against each other as its anchor rows (none with one reply per prompt)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    main_rows = generation_rows(prompts, [replies[0] for replies in a[0]], [replies[0] for replies in b[0]])
    pairs = judged(main_rows, judge, out_dir / GENERATIONS_FILE)
    samples = min(len(a[0][0]), len(b[0][0]))
    sample_rows = sample_generation_rows(prompts, a[0], b[0], samples)
    length_control = by_prompt(prompts, pairs, main_rows)
    sample_pairs = judged(sample_rows, judge, out_dir / "samples.jsonl")
    for group, extra in zip(length_control, by_prompt(prompts, sample_pairs, sample_rows), strict=True):
        group.extend(extra)
    anchor_rows = anchor_generation_rows(prompts, b[0])
    anchors = (
        by_prompt(prompts, judged(anchor_rows, judge, out_dir / "anchors.jsonl"), anchor_rows) if anchor_rows else None
    )
    tax = AlignmentTax(replies=len(prompts), perplexity_a=a[1], perplexity_b=b[1])
    settings = config.evaluation
    report = build_report(
        pairs,
        judge.info(),
        "A",
        "B",
        settings.generation,
        config.seed,
        alignment_tax=tax,
        resamples=1000,
        length_control_pairs=length_control,
        anchor_pairs=anchors,
        min_anchor_pairs=settings.min_anchor_pairs,
        min_informative_pairs=settings.min_informative_pairs,
    )
    return report.metrics()


def ppo_run_figures(guard: CollapseGuardConfig, kl: float) -> dict[str, float]:
    """The figures of a PPO run's metrics.json the gate reads, for a run the guard did not stop:
    `guard_enabled` and each bound on or off as the PPO stage writes them (stages/ppo.py: `stage_metrics`)."""
    bounds = {name: float(on) for name, on in guard.bounds_on().items()}
    return {"val/kl_best": kl, "guard_enabled": float(guard.enabled), "guard_stopped": 0.0, **bounds}


GUARDED_RUN = ppo_run_figures(CollapseGuardConfig(), kl=0.12)  # the default guard, not fired; KL within the bound


def cut(replies: Sequence[Reply], lengths: Sequence[int], tokenizer) -> list[Reply]:
    """Each reply cut to the matching length in tokens (a reply already as short stays as it is)."""
    shortened = []
    for reply, length in zip(replies, lengths):
        ids = tokenizer(reply.text, add_special_tokens=False)["input_ids"][:length]
        shortened.append(Reply(text=tokenizer.decode(ids), tokens=len(ids), finished=False))
    return shortened


def scaled(replies: Sequence[Sequence[Reply]], factor: float, tokenizer) -> list[list[Reply]]:
    """Every reply cut to `factor` of its length in tokens (rounded, at least one), or for a factor above 1
    padded to it with its own first tokens again, so what it says is kept and only its length moves; its
    length is counted as the judges count it, on its text (1.0: the replies re-counted so)."""
    moved = []
    for group in replies:
        moved.append([])
        for reply in group:
            ids = tokenizer(reply.text, add_special_tokens=False)["input_ids"]
            text = tokenizer.decode((ids * 2)[: max(1, round(len(ids) * factor))])
            tokens = len(tokenizer(text, add_special_tokens=False)["input_ids"])
            moved[-1].append(Reply(text=text, tokens=tokens, finished=False))
    return moved


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
    collapsed = tilted(setting.sft, {end_of_turn_id(tokenizer): COLLAPSE_BIAS})
    return answers(setting.config, collapsed, tokenizer, setting.prompts)


@pytest.fixture(scope="module")
def baseline(setting: Setting, tokenizer: PreTrainedTokenizerBase) -> tuple[list[list[Reply]], float]:
    """The `SAMPLES` answers to each prompt of the baseline of the length-controlled controls: the SFT model
    with replies of spread lengths."""
    model = tilted(setting.sft, {end_of_turn_id(tokenizer): BASELINE_EOT_BIAS})
    replies, perplexity = sampled_answers(setting.config, model, tokenizer, setting.prompts)
    return scaled(replies, 1.0, tokenizer), perplexity


@pytest.fixture(scope="module")
def better_answers(setting: Setting, tokenizer: PreTrainedTokenizerBase) -> tuple[list[list[Reply]], float]:
    """The better policy's `SAMPLES` answers to each prompt (seeded): the SFT model moved toward the preferred
    words, its end-of-turn token made likelier as the baseline's is (replies of about the baseline's length)."""
    eot = end_of_turn_id(tokenizer)
    biases = {**dict.fromkeys(sorted(setting.preferred), PREFERRED_WORDS_BIAS), eot: BASELINE_EOT_BIAS}
    return sampled_answers(setting.config, tilted(setting.sft, biases), tokenizer, setting.prompts)


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
        setting.config,
        setting.prompts,
        one_each(cut_answers),
        one_each(setting.sft_answers),
        brevity_judge(tokenizer),
        tmp_path,
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
        setting.config,
        setting.prompts,
        one_each(collapsed_answers),
        one_each(setting.sft_answers),
        brevity_judge(tokenizer),
        tmp_path,
    )
    training = ppo_run_figures(GUARD_OFF, kl=0.2)  # under the KL bound: KL alone would not stop it
    checks = {check.name: check for check in gate_checks(setting.config.promotion, evaluation, training)}
    described = [check.describe() for check in checks.values()]
    assert checks["kl_to_reference"].passed and checks["win_minus_loss_low"].passed, described
    assert checks["no_collapse"].describe() == (f"no_collapse = {GUARD_DISABLED} ({NO_COLLAPSE_BOUND}): FAIL")
    assert not checks["length_ratio"].passed, described


# ---- the length-controlled win rate at its edges (slow: see the module's docstring)


def lc_control_checks(setting: Setting, a, b, judge: RuleJudge, tmp_path: Path) -> tuple[dict[str, float], dict]:
    evaluation = evaluation_figures(setting.config, setting.prompts, a, b, judge, tmp_path)
    return evaluation, {check.name: check for check in gate_checks(setting.config.promotion, evaluation, GUARDED_RUN)}


@pytest.mark.slow
def test_the_baseline_has_the_length_spread_its_anchor_pairs_need(baseline) -> None:
    samples, _ = baseline
    tokens = np.array([[reply.tokens for reply in group] for group in samples])
    assert len(samples[0]) == SAMPLES and tokens.std() > 3 and (tokens < 24).mean() > 0.5


@pytest.mark.slow
@pytest.mark.parametrize("fraction", [0.75, 0.9])
def test_the_baseline_cut_short_and_judged_by_brevity_fails_on_the_length_controlled_check(
    setting: Setting, baseline, tokenizer, fraction: float, tmp_path: Path
) -> None:
    answers_b = baseline
    cut_answers = (scaled(answers_b[0], fraction, tokenizer), answers_b[1])  # the baseline itself: no tax
    judge = brevity_judge(tokenizer, SHARP_JUDGE_NOISE)
    evaluation, checks = lc_control_checks(setting, cut_answers, answers_b, judge, tmp_path)
    described = [check.describe() for check in checks.values()]
    assert evaluation["win_rate"] > evaluation["lose_rate"], described  # the judge prefers the cut replies
    assert checks["length_ratio"].passed and checks["alignment_tax_relative"].passed, described  # inside the band
    assert not checks["lc_win_rate_low"].passed, described  # the length-controlled check is the one that fails
    assert evaluation["lc_anchor_pairs"] > 0


@pytest.mark.slow
def test_the_baseline_padded_and_judged_by_verbosity_fails_on_the_length_controlled_check(
    setting: Setting, baseline, tokenizer, tmp_path: Path
) -> None:
    answers_b = baseline
    padded = (scaled(answers_b[0], 1.3, tokenizer), answers_b[1])
    evaluation, checks = lc_control_checks(setting, padded, answers_b, verbosity_judge(tokenizer), tmp_path)
    described = [check.describe() for check in checks.values()]
    assert evaluation["win_rate"] > evaluation["lose_rate"] and checks["length_ratio"].passed, described
    assert not checks["lc_win_rate_low"].passed, described


@pytest.mark.slow
@pytest.mark.parametrize(("factor", "longer"), [(0.7, False), (1.0, True)])
def test_a_genuinely_better_policy_passes_the_gate_shorter_or_longer(
    setting: Setting, baseline, better_answers, tokenizer, factor: float, longer: bool, tmp_path: Path
) -> None:
    """As it answers, the better policy is a little longer than the baseline; cut to 0.7, shorter."""
    answers_b = baseline
    replies, perplexity = better_answers
    moved = (scaled(replies, factor, tokenizer), perplexity)  # 1.0: re-counted as the judge counts
    judge = vocabulary_judge(tokenizer, setting.preferred)
    evaluation, checks = lc_control_checks(setting, moved, answers_b, judge, tmp_path)
    described = [check.describe() for check in checks.values()]
    assert (evaluation["length_ratio"] > 1) == longer, described
    assert [name for name, check in checks.items() if not check.passed] == [], described
    assert evaluation["lc_identifiable"] == 1 and evaluation["lc_win_rate_low"] > 0.5
