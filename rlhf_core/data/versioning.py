"""Adding a preference file to the versioned raw data: validate it, check it against the evaluation split,
copy it in. DVC itself (hashing, pushing) is the caller's business: see tasks/data/dvc_data.py.

The raw data is a directory of preference files (`data/raw/`) that DVC versions as one unit; the data
stage reads every file in it. A new file is checked in the context of that directory:

- validation: the data stage's own row checks, in its order (parse, token length, duplicate), with the
  rows already in the directory counting as seen before, so a row that is already there is a
  `duplicate_pair`; then the stage's run-level bound, `data.max_drop_fraction`, applied to the new file.
  A file that preparation would refuse is refused before anything is written, with the same message.
- evaluation overlap: a prompt's split is a pure function of its prompt_id (rlhf_core/data/splits.py),
  so the evaluation split stays put across data versions; a new row whose prompt is already one of the
  evaluation prompts adds a judgement to the held-out set, and the report names every such row.
- merge: the file's bytes are copied in unchanged under its own name (raw data stays raw), through a
  temporary name and os.replace, so an interrupted copy never looks like a complete file.
"""

from __future__ import annotations

import shutil
from collections import Counter
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path

from rlhf_core.atomic import atomic_file
from rlhf_core.config import DataConfig
from rlhf_core.data.formats import parse_row
from rlhf_core.data.prepare import split_config
from rlhf_core.data.readers import SUPPORTED_SUFFIXES, RawRow, open_source
from rlhf_core.data.records import Drop, PreferencePair
from rlhf_core.data.splits import Split, SplitConfig, assign_split
from rlhf_core.data.validation import DropLog, DuplicateFilter, TokenLengthFn, check_drop_fraction, check_token_length

OVERLAP_ROWS_SHOWN = 20
PROMPT_EXCERPT_CHARS = 70


@dataclass(frozen=True)
class NewFileReport:
    """What checking a new preference file found: the pairs it adds, its drops, its evaluation overlap."""

    name: str
    rows: int
    pairs: list[PreferencePair]
    drops: DropLog
    eval_overlap: list[PreferencePair]
    pairs_by_split: dict[str, int]  # new pairs per hash bucket (eval, rm_val, ppo, rm_train)

    def summary(self) -> str:
        """Human-readable lines for the command line: counts, drops, and each overlapping row."""
        drops = ", ".join(f"{reason.value} {count}" for reason, count in sorted(self.drops.counts.items()))
        splits = ", ".join(f"{split.value} {self.pairs_by_split.get(split.value, 0)}" for split in Split)
        lines = [
            f"{self.name}: {len(self.pairs)} of {self.rows} rows are new valid pairs (dropped: {drops or 'none'})",
            f"new pairs by split: {splits}",
        ]
        if not self.eval_overlap:
            lines.append("evaluation split: no new row has a prompt that is already an evaluation prompt")
            return "\n".join(lines)
        lines.append(
            f"evaluation split: {len(self.eval_overlap)} new row(s) have a prompt that is already an "
            "evaluation prompt (they join the held-out evaluation pairs):"
        )
        for pair in self.eval_overlap[:OVERLAP_ROWS_SHOWN]:
            lines.append(f"  line {pair.line}: prompt {pair.prompt_id[:12]} {prompt_excerpt(pair)!r}")
        if len(self.eval_overlap) > OVERLAP_ROWS_SHOWN:
            lines.append(f"  ... and {len(self.eval_overlap) - OVERLAP_ROWS_SHOWN} more")
        return "\n".join(lines)


def prompt_excerpt(pair: PreferencePair) -> str:
    """The start of the prompt's last message, on one line: enough for a person to recognise it."""
    text = " ".join(pair.prompt[-1]["content"].split())
    return text if len(text) <= PROMPT_EXCERPT_CHARS else text[: PROMPT_EXCERPT_CHARS - 3] + "..."


def preference_files(raw_dir: Path) -> list[Path]:
    """The preference files of the raw directory, sorted by name: what the data stage reads from it."""
    if not raw_dir.is_dir():
        return []
    return sorted(path for path in raw_dir.iterdir() if path.is_file() and path.name.endswith(SUPPORTED_SUFFIXES))


def read_raw_pairs(raw_dir: Path) -> list[PreferencePair]:
    """Every row of the raw directory that parses into a pair (no token-length check: no tokenizer needed).

    Rows that do not parse are skipped: they can neither be duplicated nor be in a split, and reporting
    them is the data stage's job.
    """
    pairs: list[PreferencePair] = []
    for path in preference_files(raw_dir):
        for item in open_source(path).rows:
            if isinstance(item, RawRow):
                parsed = parse_row(item.row, item.source, item.line)
                if isinstance(parsed, PreferencePair):
                    pairs.append(parsed)
    return pairs


def eval_prompt_ids(pairs: Sequence[PreferencePair], split: SplitConfig) -> set[str]:
    """The prompt_ids among `pairs` that the prompt-hash split puts in the evaluation split."""
    return {pair.prompt_id for pair in pairs if assign_split(pair.prompt_id, split) is Split.EVAL}


def find_eval_overlap(new_pairs: Sequence[PreferencePair], eval_ids: Collection[str]) -> list[PreferencePair]:
    """The new pairs whose prompt is already an evaluation prompt, in file order.

    `eval_ids` can come from the current raw data (eval_prompt_ids) or from a prepared eval split's
    prompt_id column; both name the same prompts, apart from pairs the data stage dropped or capped.
    """
    return [pair for pair in new_pairs if pair.prompt_id in eval_ids]


def check_new_file(path: Path, raw_dir: Path, settings: DataConfig, token_length: TokenLengthFn) -> NewFileReport:
    """Validate `path` as an addition to `raw_dir` and report its evaluation overlap; writes nothing.

    Raises FileExistsError when raw_dir already holds a file of that name, DataSourceError when the
    file cannot be read, and DataValidationError (the data stage's message) when too much of it is
    invalid or already present.
    """
    path = Path(path)
    raw_dir = Path(raw_dir)
    target = raw_dir / path.name
    if target.exists():
        raise FileExistsError(
            f"{target} already exists: the raw data holds a file of that name; rename the new file to add it"
        )
    existing = read_raw_pairs(raw_dir)
    duplicates = DuplicateFilter()
    for pair in existing:
        duplicates.check(pair)  # remembers each pair_id's first copy; repeats inside raw_dir are not ours
    rows, pairs, drops = _check_rows(path, settings, token_length, duplicates)
    check_drop_fraction(len(pairs), drops, [str(path)], settings.max_drop_fraction)
    splits = split_config(settings)
    by_split = Counter(assign_split(pair.prompt_id, splits).value for pair in pairs)
    return NewFileReport(
        name=path.name,
        rows=rows,
        pairs=pairs,
        drops=drops,
        eval_overlap=find_eval_overlap(pairs, eval_prompt_ids(existing, splits)),
        pairs_by_split=dict(by_split),
    )


def _check_rows(
    path: Path, settings: DataConfig, token_length: TokenLengthFn, duplicates: DuplicateFilter
) -> tuple[int, list[PreferencePair], DropLog]:
    """(rows read, pairs kept, drops) of the file, every row through the data stage's checks."""
    pairs: list[PreferencePair] = []
    drops = DropLog()
    rows = 0
    for item in open_source(path).rows:
        rows += 1
        checked = item if isinstance(item, Drop) else _check_row(item, settings, token_length, duplicates)
        if isinstance(checked, Drop):
            drops.add(checked)
        else:
            pairs.append(checked)
    return rows, pairs, drops


def _check_row(
    row: RawRow, settings: DataConfig, token_length: TokenLengthFn, duplicates: DuplicateFilter
) -> PreferencePair | Drop:
    """One row through the data stage's checks, in its order: parse, token length, duplicate."""
    parsed = parse_row(row.row, row.source, row.line)
    if isinstance(parsed, Drop):
        return parsed
    lengths = token_length(parsed)
    too_long = check_token_length(parsed, lengths, settings.max_total_tokens, settings.max_prompt_tokens)
    if too_long is not None:
        return too_long
    duplicate = duplicates.check(parsed)
    return parsed if duplicate is None else duplicate


def merge_into_raw(path: Path, raw_dir: Path) -> Path:
    """Copy the file into `raw_dir` under its own name, atomically; returns the new path.

    Refuses to replace an existing file: a changed file would silently rewrite rows that earlier data
    versions (and the models trained on them) were made from.
    """
    path = Path(path)
    raw_dir = Path(raw_dir)
    raw_dir.mkdir(parents=True, exist_ok=True)
    target = raw_dir / path.name
    if target.exists():
        raise FileExistsError(f"{target} already exists; rename the new file to add it")
    with atomic_file(target) as temporary:  # a killed copy's temporary file goes on the next add
        shutil.copyfile(path, temporary)
    return target
