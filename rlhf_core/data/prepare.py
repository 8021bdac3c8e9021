"""The data stage: read -> parse -> validate -> deduplicate -> split -> write, with a report of every drop.

`prepare_preference_data` reads everything and validates it before it creates anything on disk, then
writes the output directory atomically (rlhf_core.atomic.atomic_directory), so a failed run leaves no output and
never touches the previous good one. Input refused as a whole (nothing valid, or too much dropped) leaves
one file instead, beside the output directory: `<out_dir>.failed_report.json`, the drop counts with the
first rows of each reason, so the failure can be read (a later successful run removes it). Output files:

    rm_train.parquet, rm_val.parquet, eval.parquet,  pairs: pair_id, prompt_id, prompt, chosen,
    ppo_pairs.parquet                                rejected, source, line
    sft.parquet                                      prompt_id, prompt, response
    ppo_prompts.parquet, ppo_val_prompts.parquet     prompt_id, prompt
    data_report.json                                 DataReport (written last; marks the output complete)

`prompt` is a list of {role, content} structs, ready for a tokenizer's chat template.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, overload

import numpy as np
import pyarrow as pa
from pydantic import BaseModel

from rlhf_core.atomic import atomic_directory, atomic_write_text
from rlhf_core.config import DataConfig
from rlhf_core.data.formats import detect_format, parse_row
from rlhf_core.data.io import PROMPT_TYPE, read_parquet, write_parquet
from rlhf_core.data.readers import OpenedSource, RawRow, Source, open_source
from rlhf_core.data.records import Drop, DropReason, Message, PpoPrompt, PreferencePair, SftExample
from rlhf_core.data.splits import SplitConfig, Splits, split_pairs
from rlhf_core.data.validation import (
    DataValidationError,
    DropLog,
    DuplicateFilter,
    TokenLengthFn,
    TokenLengths,
    check_drop_fraction,
    check_token_length,
)
from rlhf_core.layout import DATA_REPORT_FILE, METRICS_FILE

FAILED_REPORT_SUFFIX = ".failed_report.json"
PairSplitName = Literal["rm_train", "rm_val", "eval", "ppo_pairs"]
PromptSplitName = Literal["ppo_prompts", "ppo_val_prompts"]
SplitName = Literal["rm_train", "rm_val", "eval", "sft", "ppo_prompts", "ppo_val_prompts", "ppo_pairs"]

PAIR_SCHEMA = pa.schema(
    [
        ("pair_id", pa.string()),
        ("prompt_id", pa.string()),
        ("prompt", PROMPT_TYPE),
        ("chosen", pa.string()),
        ("rejected", pa.string()),
        ("source", pa.string()),
        ("line", pa.int64()),
    ]
)
SFT_SCHEMA = pa.schema([("prompt_id", pa.string()), ("prompt", PROMPT_TYPE), ("response", pa.string())])
PPO_SCHEMA = pa.schema([("prompt_id", pa.string()), ("prompt", PROMPT_TYPE)])


def split_config(settings: DataConfig) -> SplitConfig:
    """The split rules of the `data` section, in the form splits.py takes."""
    return SplitConfig(
        eval_fraction=settings.eval_fraction,
        rm_val_fraction=settings.rm_val_fraction,
        ppo_fraction=settings.ppo_fraction,
        ppo_val_fraction=settings.ppo_val_fraction,
        salt=settings.split_salt,
        max_eval_pairs=settings.max_eval_pairs,
        max_rm_val_pairs=settings.max_rm_val_pairs,
        max_rm_train_pairs=settings.max_rm_train_pairs,
        max_ppo_prompts=settings.max_ppo_prompts,
        max_sft_examples=settings.max_sft_examples,
    )


class LengthStats(BaseModel):
    """Distribution of one token count over the kept pairs (percentiles linearly interpolated)."""

    min: int
    mean: float
    p50: float
    p95: float
    max: int


class DropExample(BaseModel):
    source: str
    line: int
    detail: str


class DropSummary(BaseModel):
    count: int
    examples: list[DropExample]


class SourceSummary(BaseModel):
    """One input: its name, sha256 of its bytes (of the dataset fingerprint for Hub data), rows, formats."""

    name: str
    sha256: str
    rows: int
    formats: dict[str, int]


class FailedDataReport(BaseModel):
    """What a refused input held: why it was refused, and what data_report.json would have said of it
    up to the split (saved as `<out_dir>.failed_report.json`)."""

    error: str
    sources: list[SourceSummary]
    input_sha256: str
    rows_read: int
    pairs_kept: int
    formats: dict[str, int]
    drops: dict[str, DropSummary]
    settings: DataConfig


class DataReport(BaseModel):
    """What was read, kept, dropped (and why), and written; saved as data_report.json."""

    sources: list[SourceSummary]
    input_sha256: str
    rows_read: int
    pairs_kept: int
    formats: dict[str, int]
    drops: dict[str, DropSummary]
    split_counts: dict[str, int]
    held_back_by_caps: dict[str, int]
    token_lengths: dict[str, LengthStats]
    settings: DataConfig

    def metrics(self) -> dict[str, float]:
        """The flat figures of metrics.json (documented in the README, "Stage outputs")."""
        dropped = self.rows_read - self.pairs_kept
        figures: dict[str, float] = {
            "rows_read": self.rows_read,
            "pairs_kept": self.pairs_kept,
            "rows_dropped": dropped,
            "drop_fraction": dropped / self.rows_read if self.rows_read else 0.0,
        }
        figures.update({f"split.{name}": count for name, count in self.split_counts.items()})
        figures.update({f"dropped.{reason}": drop.count for reason, drop in self.drops.items()})
        figures.update({f"tokens.{part}.p95": stats.p95 for part, stats in self.token_lengths.items()})
        return figures

    def summary(self) -> str:
        """A few human-readable lines for the command line."""
        drops = ", ".join(f"{reason} {drop.count}" for reason, drop in self.drops.items() if drop.count)
        splits = ", ".join(f"{name} {count}" for name, count in self.split_counts.items())
        return (
            f"kept {self.pairs_kept} of {self.rows_read} rows (dropped: {drops or 'none'})\n"
            f"splits: {splits}\ninput sha256: {self.input_sha256}"
        )


@dataclass
class _Collected:
    """Everything read from the inputs: kept pairs with their token lengths, drops, per-source summaries."""

    pairs: list[PreferencePair] = field(default_factory=list)
    lengths: list[TokenLengths] = field(default_factory=list)
    drops: DropLog = field(default_factory=DropLog)
    duplicates: DuplicateFilter = field(default_factory=DuplicateFilter)
    sources: list[SourceSummary] = field(default_factory=list)


def prepare_preference_data(
    sources: Sequence[Source], out_dir: Path, settings: DataConfig, token_length: TokenLengthFn
) -> DataReport:
    """Prepare split preference datasets from local files and/or Hub datasets into `out_dir`.

    Raises DataSourceError (an input cannot be read) or DataValidationError (too much was dropped)
    before `out_dir` is touched; `out_dir` is replaced only by a complete new output. A
    DataValidationError names the failed report (`failed_report_path`) it wrote first.
    """
    out_dir = Path(out_dir)
    collected = _Collected()
    for source in sources:
        _collect_source(open_source(source), settings, token_length, collected)
    try:
        check_drop_fraction(
            len(collected.pairs),
            collected.drops,
            [summary.name for summary in collected.sources],
            settings.max_drop_fraction,
        )
    except DataValidationError as error:
        failed = _write_failed_report(out_dir, collected, settings, str(error))
        raise DataValidationError(f"{error}; every drop is in {failed}") from None
    splits = split_pairs(collected.pairs, split_config(settings))
    report = _build_report(collected, splits, settings)
    with atomic_directory(out_dir) as temp_dir:
        _write_splits(temp_dir, splits)
        (temp_dir / METRICS_FILE).write_text(json.dumps(report.metrics(), indent=2), encoding="utf-8")
        (temp_dir / DATA_REPORT_FILE).write_text(report.model_dump_json(indent=2), encoding="utf-8")
    failed_report_path(out_dir).unlink(missing_ok=True)  # an earlier refusal no longer describes this output
    return report


def failed_report_path(out_dir: Path) -> Path:
    """`<out_dir>.failed_report.json`: beside the output directory, since a file inside would make a
    previous complete output look changed."""
    return out_dir.with_name(out_dir.name + FAILED_REPORT_SUFFIX)


def _write_failed_report(out_dir: Path, collected: _Collected, settings: DataConfig, error: str) -> Path:
    report = FailedDataReport(
        error=error,
        sources=collected.sources,
        input_sha256=_input_sha256(collected),
        rows_read=sum(summary.rows for summary in collected.sources),
        pairs_kept=len(collected.pairs),
        formats=_formats(collected),
        drops=_drop_summaries(collected),
        settings=settings,
    )
    return atomic_write_text(failed_report_path(out_dir), report.model_dump_json(indent=2) + "\n")


@overload
def load_split(out_dir: Path, name: PairSplitName) -> list[PreferencePair]: ...
@overload
def load_split(out_dir: Path, name: Literal["sft"]) -> list[SftExample]: ...
@overload
def load_split(out_dir: Path, name: PromptSplitName) -> list[PpoPrompt]: ...
def load_split(out_dir: Path, name: SplitName) -> list[PreferencePair] | list[SftExample] | list[PpoPrompt]:
    """Read one prepared split back as records; refuses a directory without data_report.json.

    ppo_pairs.parquet and ppo_val_prompts.parquet are missing from data prepared by older versions of this
    project; preparing the same data again adds them (the PPO validation slice leaves the PPO prompts).
    """
    out_dir = Path(out_dir)
    if not (out_dir / DATA_REPORT_FILE).is_file():
        raise FileNotFoundError(f"{out_dir} holds no complete prepared data ({DATA_REPORT_FILE} is missing)")
    path = out_dir / f"{name}.parquet"
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing: {out_dir} was prepared by an older version; prepare the data again (the "
            "splits do not change): `rlhf prepare-data`, or in the pipeline delete that directory and its "
            "prepare-data stage runs again"
        )
    rows = read_parquet(path)
    if name == "sft":
        return [
            SftExample(prompt_id=row["prompt_id"], prompt=_prompt_from_row(row), response=row["response"])
            for row in rows
        ]
    if name in ("ppo_prompts", "ppo_val_prompts"):
        return [PpoPrompt(prompt_id=row["prompt_id"], prompt=_prompt_from_row(row)) for row in rows]
    return [
        PreferencePair(
            prompt=_prompt_from_row(row),
            chosen=row["chosen"],
            rejected=row["rejected"],
            source=row["source"],
            line=row["line"],
        )
        for row in rows
    ]


def load_report(out_dir: Path) -> DataReport:
    """Read data_report.json of a prepared output directory."""
    return DataReport.model_validate_json((Path(out_dir) / DATA_REPORT_FILE).read_text(encoding="utf-8"))


def _collect_source(
    opened: OpenedSource, settings: DataConfig, token_length: TokenLengthFn, collected: _Collected
) -> None:
    rows = 0
    formats: Counter[str] = Counter()
    for item in opened.rows:
        rows += 1
        if isinstance(item, RawRow):
            row_format = detect_format(item.row)
            if row_format is not None:
                formats[row_format.value] += 1
            _collect_row(item, settings, token_length, collected)
        else:
            collected.drops.add(item)
    collected.sources.append(SourceSummary(name=opened.name, sha256=opened.sha256, rows=rows, formats=dict(formats)))


def _collect_row(row: RawRow, settings: DataConfig, token_length: TokenLengthFn, collected: _Collected) -> None:
    """Parse, length-check and deduplicate one row, adding it to the kept pairs or to the drop log."""
    parsed = parse_row(row.row, row.source, row.line)
    if isinstance(parsed, Drop):
        collected.drops.add(parsed)
        return
    lengths = token_length(parsed)
    too_long = check_token_length(parsed, lengths, settings.max_total_tokens, settings.max_prompt_tokens)
    if too_long is not None:
        collected.drops.add(too_long)
        return
    duplicate = collected.duplicates.check(parsed)
    if duplicate is not None:
        collected.drops.add(duplicate)
        return
    collected.pairs.append(parsed)
    collected.lengths.append(lengths)


def _length_stats(values: list[int]) -> LengthStats:
    array = np.asarray(values)
    return LengthStats(
        min=int(array.min()),
        mean=float(array.mean()),
        p50=float(np.percentile(array, 50)),
        p95=float(np.percentile(array, 95)),
        max=int(array.max()),
    )


def _formats(collected: _Collected) -> dict[str, int]:
    formats: Counter[str] = Counter()
    for summary in collected.sources:
        formats.update(summary.formats)
    return dict(formats)


def _drop_summaries(collected: _Collected) -> dict[str, DropSummary]:
    return {
        reason.value: DropSummary(
            count=collected.drops.counts.get(reason, 0),
            examples=[
                DropExample(source=drop.source, line=drop.line, detail=drop.detail)
                for drop in collected.drops.examples.get(reason, [])
            ],
        )
        for reason in DropReason
    }


def _input_sha256(collected: _Collected) -> str:
    source_hashes = "\n".join(summary.sha256 for summary in collected.sources)
    return hashlib.sha256(source_hashes.encode("utf-8")).hexdigest()


def _build_report(collected: _Collected, splits: Splits, settings: DataConfig) -> DataReport:
    return DataReport(
        sources=collected.sources,
        input_sha256=_input_sha256(collected),
        rows_read=sum(summary.rows for summary in collected.sources),
        pairs_kept=len(collected.pairs),
        formats=_formats(collected),
        drops=_drop_summaries(collected),
        split_counts={
            "rm_train": len(splits.rm_train),
            "rm_val": len(splits.rm_val),
            "eval": len(splits.eval),
            "sft": len(splits.sft),
            "ppo_prompts": len(splits.ppo_prompts),
            "ppo_val_prompts": len(splits.ppo_val_prompts),
            "ppo_pairs": len(splits.ppo_pairs),
        },
        held_back_by_caps=splits.held_back_by_caps,
        token_lengths={
            "prompt": _length_stats([lengths.prompt for lengths in collected.lengths]),
            "chosen": _length_stats([lengths.prompt_and_chosen - lengths.prompt for lengths in collected.lengths]),
            "rejected": _length_stats([lengths.prompt_and_rejected - lengths.prompt for lengths in collected.lengths]),
        },
        settings=settings,
    )


def _pair_row(pair: PreferencePair) -> dict[str, object]:
    return {
        "pair_id": pair.pair_id,
        "prompt_id": pair.prompt_id,
        "prompt": [dict(message) for message in pair.prompt],
        "chosen": pair.chosen,
        "rejected": pair.rejected,
        "source": pair.source,
        "line": pair.line,
    }


def _prompt_from_row(row: dict[str, Any]) -> tuple[Message, ...]:
    return tuple(Message(role=message["role"], content=message["content"]) for message in row["prompt"])


def _write_splits(directory: Path, splits: Splits) -> None:
    pair_splits = (
        ("rm_train", splits.rm_train),
        ("rm_val", splits.rm_val),
        ("eval", splits.eval),
        ("ppo_pairs", splits.ppo_pairs),
    )
    for name, pairs in pair_splits:
        write_parquet(directory / f"{name}.parquet", [_pair_row(pair) for pair in pairs], PAIR_SCHEMA)
    sft_rows = [
        {
            "prompt_id": example.prompt_id,
            "prompt": [dict(message) for message in example.prompt],
            "response": example.response,
        }
        for example in splits.sft
    ]
    write_parquet(directory / "sft.parquet", sft_rows, SFT_SCHEMA)
    for name, prompts in (("ppo_prompts", splits.ppo_prompts), ("ppo_val_prompts", splits.ppo_val_prompts)):
        rows = [
            {"prompt_id": prompt.prompt_id, "prompt": [dict(message) for message in prompt.prompt]}
            for prompt in prompts
        ]
        write_parquet(directory / f"{name}.parquet", rows, PPO_SCHEMA)
