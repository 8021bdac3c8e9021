"""`score-pairs`: a trained reward model's accuracy on any preference file (paper section 4.2's check).

Reads every pair of the file (a file, a directory or a Hub id, parsed as prepare-data parses rows;
unreadable rows are counted, not fatal), scores chosen and rejected with the model `train-rm` saved,
and reports the accuracy with its 95% Wilson interval, the mean margin and the model's skill beyond reply
length (rlhf_core/reward/length_metrics.py: balanced and length-matched accuracy, the length rule, the AUC
gain over length, the reward-length correlation); with an output directory also metrics.json and the
margin histogram (the paper's Figure 2), as `train-rm` writes them (its figures without the `val/` prefix).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rlhf_core.config import Config
from rlhf_core.data.formats import parse_row
from rlhf_core.data.readers import RawRow, open_source
from rlhf_core.data.records import PreferencePair
from rlhf_core.layout import MODEL_DIR
from rlhf_core.models.base import DTYPES
from rlhf_core.models.heads import RewardModel
from rlhf_core.models.loading import load_tokenizer
from rlhf_core.models.saving import HEAD_CONFIG_FILE
from rlhf_core.output_lock import output_lock
from rlhf_core.progress import ProgressCallback, progress
from rlhf_core.reward.batch import collate_pairs, encode_pairs, pair_reply_tokens
from rlhf_core.reward.length_metrics import LengthSkill, length_skill
from rlhf_core.reward.metrics import PairAccuracy, pair_accuracy
from rlhf_core.reward.plots import plot_margin_histogram
from rlhf_core.reward.scoring import PairScores, score_pair_batches
from rlhf_core.stages.precision import resolve_precision
from rlhf_core.stages.prepare_data import resolve_sources
from rlhf_core.stages.result import write_metrics
from rlhf_core.stages.reward import MARGIN_PLOT
from rlhf_core.stages.training_run import mark_incomplete, training_device
from rlhf_core.training.precision import autocast


@dataclass(frozen=True)
class PairFileScores:
    """A reward model's verdict on a pair file: accuracy summary, skill beyond length, raw scores, and what
    was left out."""

    accuracy: PairAccuracy
    length: LengthSkill
    scores: PairScores
    rows_dropped: int
    pairs_too_long: int


def reward_model_dir(path: Path) -> Path:
    """The saved reward model: `path` itself, or `path/model` for a train-rm stage output directory."""
    for candidate in (path, path / MODEL_DIR):
        if (candidate / HEAD_CONFIG_FILE).is_file():
            return candidate
    raise FileNotFoundError(
        f"{path} is neither a saved reward model nor a train-rm output directory (no {HEAD_CONFIG_FILE})"
    )


def read_pairs(source: str, config: Config) -> tuple[list[PreferencePair], int]:
    """Every preference pair in `source` (a file, a directory of files, or a Hub id), and the rows dropped."""
    pairs: list[PreferencePair] = []
    dropped = 0
    for resolved in resolve_sources(source, config):
        for item in open_source(resolved).rows:
            parsed = parse_row(item.row, item.source, item.line) if isinstance(item, RawRow) else item
            if isinstance(parsed, PreferencePair):
                pairs.append(parsed)
            else:
                dropped += 1
    return pairs, dropped


def score_pair_file(
    config: Config,
    model_path: Path,
    source: str,
    out_dir: Path | None = None,
    on_progress: ProgressCallback | None = None,
) -> PairFileScores:
    """Score every pair of `source` with the reward model at `model_path`; optionally write the results.

    A progress bar counts the pairs scored (rlhf_core/progress.py), and `on_progress(done, total)` with it.

    With `out_dir`: metrics.json (accuracy, interval, margins, counts, the figures of `LengthSkill`) and
    plots/reward_margin_hist.png, written holding the output lock of `out_dir` for the whole run
    (rlhf_core/output_lock.py), so two runs into one directory cannot mix their figures; nothing is
    written there until the scores exist.
    """
    if out_dir is None:
        return _score_pair_file(config, Path(model_path), source, on_progress)
    out_dir = Path(out_dir)
    with output_lock(out_dir, "score-pairs"):
        result = _score_pair_file(config, Path(model_path), source, on_progress)
        out_dir.mkdir(parents=True, exist_ok=True)
        mark_incomplete(out_dir)  # a finished directory stays finished until this run writes
        plot_margin_histogram(
            result.scores.margins, out_dir / MARGIN_PLOT, title=f"Reward margins on {Path(source).name}"
        )
        write_metrics(
            out_dir,
            {
                "accuracy": result.accuracy.accuracy,
                "accuracy_low": result.accuracy.low,
                "accuracy_high": result.accuracy.high,
                "margin_mean": result.accuracy.mean_margin,
                "pairs": float(result.accuracy.pairs),
                "rows_dropped": float(result.rows_dropped),
                "pairs_too_long": float(result.pairs_too_long),
                **result.length.figures(),
            },
        )
    return result


def _score_pair_file(
    config: Config, model_path: Path, source: str, on_progress: ProgressCallback | None
) -> PairFileScores:
    directory = reward_model_dir(model_path)
    device = training_device()
    bf16 = resolve_precision(config, device, "score-pairs").distributed.uses_bf16
    model = RewardModel.from_pretrained(directory, dtype=DTYPES[config.model.dtype], device=device)
    tokenizer = load_tokenizer(directory)
    pairs, dropped = read_pairs(source, config)
    encoded = encode_pairs(tokenizer, pairs, config.reward.max_length)
    if not encoded.pairs:
        raise ValueError(
            f"{source}: no pair could be scored ({dropped} rows unreadable, {len(encoded.too_long)} too long)"
        )
    chunks = [
        list(range(start, min(start + config.reward.micro_batch_size, len(encoded.pairs))))
        for start in range(0, len(encoded.pairs), config.reward.micro_batch_size)
    ]
    batches = (collate_pairs([encoded.pairs[i] for i in chunk], chunk, tokenizer.pad_token_id) for chunk in chunks)
    with progress(len(encoded.pairs), "score-pairs", "pair", on_progress) as scored:
        with autocast(device, bf16):
            scores = score_pair_batches(model, batches, cache=None, with_lm_loss=False, on_scored=scored.advance)
    length = length_skill(scores.chosen, scores.rejected, *pair_reply_tokens(encoded.pairs), seed=config.seed)
    return PairFileScores(pair_accuracy(scores.margins), length, scores, dropped, len(encoded.too_long))
