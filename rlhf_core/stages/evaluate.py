"""Stage `eval`: model A against model B on the held-out evaluation prompts (paper section 6).

Inputs: `data_dir` (prepared data; its `eval` split), `model_a` and `model_b` (stage output directories
such as artifacts/ppo and artifacts/sft, or plain Hugging Face model directories; A is the model under
evaluation, B the baseline), and the judge: "rm" (default: a reward model, `rm_dir`) or "llm" (an
OpenAI-compatible API named by environment variables, judges/llm_endpoint.py). Human judging runs in
the `rlhf-human-eval` Prefect flow, not here. Whether a reward-model judge is in-sample (the reward
model model A was optimised against) is read from model A's reward record (`judge_in_sample`).

Outputs in `out_dir`:

    generations.jsonl    both models' replies to each prompt, with prompt ids (outputs.py)
    verdicts.jsonl       the judge's verdict on each pair and what it was based on
    generations_matched.jsonl, verdicts_matched.jsonl
                         the same for the length-matched pairs: per prompt, the closest-length pair of
                         `evaluation.length_matched_samples` replies per model, chosen before judging
                         (length_matching.py); the report leads with them and the length-controlled win rate
    generations_samples.jsonl, verdicts_samples.jsonl
                         the same for the further pairs the length-controlled win rate is fitted on: A's
                         i-th reply against B's i-th, i = 1 .. `evaluation.length_controlled_samples` - 1
    generations_anchors.jsonl, verdicts_anchors.jsonl
                         the same for its anchor rows: B's i-th reply against its (i+1)-th (length_control.py)
    report.json          the EvaluationReport (report.py)
    report.md            the same for people
    plots/win_rate.png   the paper's Figure 10-style win/tie/lose chart
    judge_cache/         the LLM judge's cache (llm judge only; kept across reruns)
    metrics.json         headline figures, written LAST: the evaluation is complete iff it exists

Everything that can be checked before the slow work is checked first: the judge and its configuration,
the model and reward-model directories, other judges' verdict files, the eval split. A rerun into the same
`out_dir` regenerates the replies (same seed, same replies on the same hardware) and reuses every cached
LLM verdict; given a replies store, a model sampled before with the same settings is read from it instead
(rlhf_core/evaluation/model_replies.py). The stage holds the output lock of `out_dir` throughout
(rlhf_core/output_lock.py): a second evaluation into the same directory fails at once, naming the first.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from rlhf_core.atomic import atomic_write_text
from rlhf_core.config import Config
from rlhf_core.evaluation.alignment_tax import AlignmentTax, reply_perplexity
from rlhf_core.evaluation.generation import Reply, generate_replies, sample_replies
from rlhf_core.evaluation.judged_pairs import GeneratedPairs, Judgements, judge_pairs, judged_pairs
from rlhf_core.evaluation.judges.llm import LlmJudge
from rlhf_core.evaluation.judges.llm_endpoint import LlmEndpoint
from rlhf_core.evaluation.judges.reward_model import RewardModelJudge
from rlhf_core.evaluation.judges.verdicts import Judge, JudgeInfo, Verdict
from rlhf_core.evaluation.length_matching import length_matched_pairs
from rlhf_core.evaluation.model_dirs import REWARD_MODEL_MARKER, resolve_model_dir
from rlhf_core.evaluation.model_replies import ModelReplies, ReplyStore, replies_key
from rlhf_core.evaluation.outputs import (
    ANCHOR_GENERATIONS_FILE,
    GENERATIONS_FILE,
    MATCHED_GENERATIONS_FILE,
    SAMPLE_GENERATIONS_FILE,
    anchor_generation_rows,
    generation_rows,
    matched_generation_rows,
    read_generations,
    read_verdicts,
    sample_generation_rows,
    write_jsonl,
)
from rlhf_core.evaluation.plots import plot_win_tie_lose
from rlhf_core.evaluation.ppo_evidence import ppo_evidence_markdown
from rlhf_core.evaluation.prompts import EvalPrompt, evaluation_prompts
from rlhf_core.evaluation.report import EvaluationReport, build_report
from rlhf_core.evaluation.report_markdown import render_markdown
from rlhf_core.layout import METRICS_FILE, PLOTS_DIR
from rlhf_core.models.base import DTYPES
from rlhf_core.models.loading import load_causal_lm
from rlhf_core.output_lock import output_lock
from rlhf_core.stages.ppo import reward_record
from rlhf_core.stages.precision import precision_record, resolve_precision
from rlhf_core.stages.result import StageResult, write_metrics
from rlhf_core.stages.training_run import model_dir_sha256, training_device
from rlhf_core.training.logger import MetricsLogger, NullLogger
from rlhf_core.training.precision import autocast

JudgeKind = Literal["rm", "llm"]
JUDGES: tuple[str, ...] = ("rm", "llm")
EXTRA_SAMPLES_SEED_OFFSET = 1  # the extra replies are sampled from seed + this: other draws than the main ones
REPORT_JSON = "report.json"
REPORT_MD = "report.md"
PLOT_FILE = Path(PLOTS_DIR) / "win_rate.png"
JUDGE_CACHE_DIR = "judge_cache"
HUMAN_JUDGE_MESSAGE = (
    "human judging is answered by people in the Prefect UI: run `rlhf eval` with the rm or llm judge, then "
    "the rlhf-human-eval deployment (`rlhf serve`, then Run in the UI) on its generations.jsonl"
)


def check_judge(judge: str, rm_dir: Path | None) -> None:
    """Refuse an unknown judge, the human judge (a flow), and the rm judge without a reward model."""
    if judge == "human":
        raise ValueError(HUMAN_JUDGE_MESSAGE)
    if judge not in JUDGES:
        raise ValueError(f"unknown judge {judge!r}; choose one of {', '.join(JUDGES)} (or human, in the flow)")
    if judge == "rm" and rm_dir is None:
        raise ValueError("the reward-model judge needs a reward model: pass rm_dir (a train-rm output directory)")


def main_replies(
    config: Config,
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[EvalPrompt],
    label: str | None = None,
) -> list[Reply]:
    """The main reply to each prompt (seed `seed`): the one the judge compares. With `label`, a progress
    bar named by it counts them."""
    settings = config.evaluation
    return generate_replies(
        model,
        tokenizer,
        [prompt.prompt for prompt in prompts],
        settings.generation,
        settings.batch_size,
        config.seed,
        desc=None if label is None else f"eval: {label}",
    )


def extra_replies(
    config: Config,
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[EvalPrompt],
    label: str | None = None,
) -> list[list[Reply]]:
    """For the length-matched pairs, the `evaluation.length_matched_samples - 1` further replies to each
    prompt (seed `seed + 1`; none when it is 1). With `label`, a progress bar named by it counts them."""
    settings = config.evaluation
    if settings.length_matched_samples == 1:
        return [[] for _ in prompts]
    return sample_replies(
        model,
        tokenizer,
        [prompt.prompt for prompt in prompts],
        settings.generation,
        settings.batch_size,
        config.seed + EXTRA_SAMPLES_SEED_OFFSET,
        settings.length_matched_samples - 1,
        desc=None if label is None else f"eval: {label}, length-matched samples",
    )


def draw_replies(
    config: Config,
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[EvalPrompt],
    label: str | None,
) -> tuple[list[Reply], list[list[Reply]]]:
    """The main reply to each prompt and the further ones for the length-matched pairs."""
    return main_replies(config, model, tokenizer, prompts, label), extra_replies(
        config, model, tokenizer, prompts, label
    )


def sample_model_replies(
    config: Config, model_dir: Path, prompts: Sequence[EvalPrompt], device: torch.device, label: str
) -> ModelReplies:
    """One model's replies to `prompts` (`draw_replies`) and its perplexity on their reference replies."""
    model, tokenizer = load_causal_lm(model_dir, dtype=DTYPES[config.model.dtype], device=device)
    main, extra = draw_replies(config, model, tokenizer, prompts, label)
    references = [(prompt.prompt, prompt.reference_reply) for prompt in prompts]
    perplexity, measured = reply_perplexity(
        model, tokenizer, references, config.sft.max_length, config.sft.micro_batch_size
    )
    return ModelReplies(main, extra, perplexity, measured)


def model_replies(
    config: Config,
    model_dir: Path,
    prompts: Sequence[EvalPrompt],
    device: torch.device,
    label: str,
    store: ReplyStore | None,
) -> ModelReplies:
    """`sample_model_replies`, or with a `store`, what it holds for this model and these settings (sampled
    and stored the first time)."""
    if store is None:
        return sample_model_replies(config, model_dir, prompts, device, label)
    key = replies_key(model_dir_sha256(model_dir), prompts, config, device)
    replies = store.load(key)
    if replies is None:
        replies = sample_model_replies(config, model_dir, prompts, device, label)
        store.save(key, replies)
    return replies


def build_judge(
    config: Config,
    judge: JudgeKind,
    rm_dir: Path | None,
    rm_in_sample: bool,
    endpoint: LlmEndpoint | None,
    cache_dir: Path,
    device: torch.device,
) -> Judge:
    """The reward-model judge or the LLM judge, configured from `config.evaluation`."""
    settings = config.evaluation
    if judge == "llm":
        assert endpoint is not None  # resolved by run_evaluate before any slow work
        return LlmJudge(endpoint, cache_dir, settings.llm_concurrency, settings.llm_max_retries)
    assert rm_dir is not None  # check_judge
    return RewardModelJudge.from_directory(
        rm_dir,
        settings.tie_margin,
        config.reward.micro_batch_size,
        rm_in_sample,
        dtype=DTYPES[config.model.dtype],
        device=device,
    )


def judge_in_sample(model_a: Path, rm_dir: Path, claimed: bool | None) -> bool:
    """Whether the reward model in `rm_dir` is the one model A was optimised against (an in-sample judge).

    Model A's reward record decides when it has one (the PPO stage writes it; a policy downloaded from
    the registry carries one): the same content sha256 is in-sample. Without a record `claimed`
    decides, and None is taken as in-sample, the safe assumption. Claiming independence of the very
    reward model the record names is an error.
    """
    record = reward_record(model_a)
    if record is None:
        return True if claimed is None else claimed
    in_sample = record["sha256"] == model_dir_sha256(resolve_model_dir(rm_dir, REWARD_MODEL_MARKER))
    if in_sample and claimed is False:
        raise ValueError(
            f"the reward model {rm_dir} is the one model A ({model_a}) was optimised against "
            f"({record['path']}): it cannot judge as an independent reward model"
        )
    return in_sample


@dataclass(frozen=True)
class CheckedInputs:
    """What `run_evaluate` resolves and checks before any slow work, so a bad input fails in seconds."""

    dir_a: Path
    dir_b: Path
    prompts: list[EvalPrompt]
    endpoint: LlmEndpoint | None  # the LLM judge's, else None
    in_sample: bool  # the reward-model judge is the one PPO optimised against
    others: dict[str, dict[str, Verdict]]  # other judges' verdicts on the same pairs, by judge name


def check_inputs(
    config: Config,
    data_dir: Path,
    model_a: Path,
    model_b: Path,
    judge: JudgeKind,
    rm_dir: Path | None,
    rm_in_sample: bool | None,
    other_verdicts: Sequence[Path],
) -> CheckedInputs:
    """The judge and its configuration, the model and reward-model directories, other judges' verdict
    files and the eval split, checked in that order (see `run_evaluate` for the arguments)."""
    check_judge(judge, rm_dir)
    endpoint = LlmEndpoint.from_environment(config.evaluation.llm_model) if judge == "llm" else None
    if rm_dir is not None:
        resolve_model_dir(rm_dir, REWARD_MODEL_MARKER)
    in_sample = judge == "rm" and rm_dir is not None and judge_in_sample(Path(model_a), rm_dir, rm_in_sample)
    dir_a, dir_b = resolve_model_dir(model_a), resolve_model_dir(model_b)
    others = dict(read_verdicts(Path(path)) for path in other_verdicts)
    prompts = evaluation_prompts(Path(data_dir), config.evaluation.max_prompts)
    return CheckedInputs(dir_a, dir_b, prompts, endpoint, in_sample, others)


def generate_pairs(
    config: Config,
    checked: CheckedInputs,
    out_dir: Path,
    device: torch.device,
    logger: MetricsLogger,
    replies_dir: Path | None,
) -> tuple[GeneratedPairs, AlignmentTax]:
    """Both models' replies (from the `ReplyStore` in `replies_dir` where it holds them), stored in the
    generations files (module doc) and read back, so the judge sees exactly what was stored, and the
    alignment tax: each model's perplexity on the held-out reference replies."""
    store = ReplyStore(replies_dir) if replies_dir is not None else None
    replies_a = model_replies(config, checked.dir_a, checked.prompts, device, "model A", store)
    logger.log_metrics({"progress": 0.3}, step=1)
    replies_b = model_replies(config, checked.dir_b, checked.prompts, device, "model B", store)
    logger.log_metrics({"progress": 0.6}, step=2)
    write_jsonl(out_dir / GENERATIONS_FILE, generation_rows(checked.prompts, replies_a.main, replies_b.main))
    matched = length_matched_pairs(checked.prompts, replies_a.samples(), replies_b.samples())
    write_jsonl(out_dir / MATCHED_GENERATIONS_FILE, matched_generation_rows(matched))
    pairs_per_prompt = config.evaluation.pairs_per_prompt
    sample_rows = sample_generation_rows(checked.prompts, replies_a.samples(), replies_b.samples(), pairs_per_prompt)
    write_jsonl(out_dir / SAMPLE_GENERATIONS_FILE, sample_rows)
    write_jsonl(out_dir / ANCHOR_GENERATIONS_FILE, anchor_generation_rows(checked.prompts, replies_b.samples()))
    tax = AlignmentTax(replies_a.measured, perplexity_a=replies_a.perplexity, perplexity_b=replies_b.perplexity)
    pairs = GeneratedPairs(
        main=read_generations(out_dir / GENERATIONS_FILE),
        matched=read_generations(out_dir / MATCHED_GENERATIONS_FILE),
        samples=read_generations(out_dir / SAMPLE_GENERATIONS_FILE),
        anchors=read_generations(out_dir / ANCHOR_GENERATIONS_FILE),
    )
    return pairs, tax


def judged_report(
    config: Config,
    generated: GeneratedPairs,
    judgements: Judgements,
    info: JudgeInfo,
    names: tuple[str, str],
    tax: AlignmentTax,
    others: dict[str, dict[str, Verdict]],
) -> EvaluationReport:
    """The report of the judged pairs of every kind (report.py's `build_report`)."""
    settings = config.evaluation
    main = judged_pairs(generated.main, judgements.main)
    samples = (generated.samples, judged_pairs(generated.samples, judgements.samples))
    return build_report(
        main, info, *names, settings.generation, config.seed, alignment_tax=tax, other_judges=others,
        length_matched=judged_pairs(generated.matched, judgements.matched),
        samples_per_model=settings.length_matched_samples,
        length_control_pairs=generated.by_prompt((generated.main, main), samples),
        anchor_pairs=generated.by_prompt((generated.anchors, judged_pairs(generated.anchors, judgements.anchors))),
        min_anchor_pairs=settings.min_anchor_pairs, min_informative_pairs=settings.min_informative_pairs,
    )  # fmt: skip


def write_report(report: EvaluationReport, model_a: Path, out_dir: Path) -> None:
    """report.json, report.md (with model A's PPO evidence, when it is a PPO output) and the chart."""
    atomic_write_text(out_dir / REPORT_JSON, report.model_dump_json(indent=2) + "\n")
    evidence = ppo_evidence_markdown(Path(model_a))
    atomic_write_text(out_dir / REPORT_MD, render_markdown(report) + (f"\n{evidence}" if evidence else ""))
    plot_win_tie_lose(report, out_dir / PLOT_FILE)


def evaluation_params(
    config: Config, resolved: Config, judge: JudgeKind, model_a: Path, model_b: Path
) -> dict[str, object]:
    """What an evaluation logs as its parameters: the evaluation settings as asked, the judge, the models, the
    seed and the precision they resolved to (`resolved`)."""
    return {
        "evaluation": config.evaluation.model_dump(mode="json"),
        "judge": judge,
        "model_a": str(model_a),
        "model_b": str(model_b),
        "seed": config.seed,
        "precision": precision_record(resolved),
    }


def run_evaluate(
    config: Config,
    data_dir: Path,
    model_a: Path,
    model_b: Path,
    out_dir: Path,
    judge: JudgeKind = "rm",
    rm_dir: Path | None = None,
    *,
    rm_in_sample: bool | None = None,
    other_verdicts: Sequence[Path] = (),
    judge_cache_dir: Path | None = None,
    replies_dir: Path | None = None,
    names: tuple[str, str] | None = None,
    logger: MetricsLogger | None = None,
) -> StageResult:
    """Compare model A with model B on the eval split; see the module docstring.

    `rm_in_sample`: whether the judging reward model is the one PPO optimised against, for a model A that
    does not record it (`judge_in_sample`; None: assume so, and the report flags the verdicts as
    in-sample). `other_verdicts`: other judges' verdicts.jsonl on the same pairs, for agreement figures.
    `judge_cache_dir`: the LLM judge's cache (default `out_dir/judge_cache`). `replies_dir`: models'
    replies kept between evaluations (`ReplyStore`; None: both are sampled). `names`: how the report names
    A and B (default: the paths). Holds the output lock of `out_dir` throughout (output_lock.py); checks
    every input before touching `out_dir`: a rerun failing on its inputs leaves a finished one finished.
    """
    started = time.perf_counter()
    out_dir = Path(out_dir)
    logger = logger if logger is not None else NullLogger()
    with output_lock(out_dir, "evaluate"):
        checked = check_inputs(config, data_dir, model_a, model_b, judge, rm_dir, rm_in_sample, other_verdicts)
        device = training_device()
        requested, config = config, resolve_precision(config, device, "evaluate")
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / METRICS_FILE).unlink(missing_ok=True)  # incomplete until written again
        logger.log_params(evaluation_params(requested, config, judge, model_a, model_b))
        logger.log_metrics({"progress": 0.0}, step=0)
        with autocast(device, config.distributed.uses_bf16):  # sampling, perplexity and the judge's scoring
            generated, tax = generate_pairs(config, checked, out_dir, device, logger, replies_dir)
            cache_dir = judge_cache_dir or out_dir / JUDGE_CACHE_DIR
            judge_impl = build_judge(config, judge, rm_dir, checked.in_sample, checked.endpoint, cache_dir, device)
            judgements = judge_pairs(judge_impl, generated, out_dir)
        logger.log_metrics({"progress": 0.9}, step=3)
        names = names or (str(model_a), str(model_b))
        report = judged_report(config, generated, judgements, judge_impl.info(), names, tax, checked.others)
        write_report(report, Path(model_a), out_dir)
        metrics = {**report.metrics(), "wall_time_s": time.perf_counter() - started}
        logger.log_metrics({"progress": 1.0}, step=4)
        write_metrics(out_dir, metrics)
    return StageResult(out_dir=out_dir, metrics=metrics, model_dir=None)
