"""Stage `prepare-data`: preference pairs from a file or the Hub -> validated, split parquet datasets.

Token lengths are measured exactly as training will see the text: through the base model's tokenizer
and chat template (rlhf_core.models.chat), so `data.max_total_tokens` drops what SFT and the reward
model would otherwise have to truncate. The stage holds its output directory's lock throughout
(rlhf_core/output_lock.py).
"""

from __future__ import annotations

from pathlib import Path

from transformers import PreTrainedTokenizerBase

from rlhf_core.config import Config
from rlhf_core.data.prepare import DataReport, prepare_preference_data
from rlhf_core.data.readers import DataSourceError, HubDataset, Source
from rlhf_core.data.records import PreferencePair
from rlhf_core.data.validation import TokenLengthFn, TokenLengths
from rlhf_core.models.base import load_base_tokenizer
from rlhf_core.models.chat import encode_conversation, encode_prompt
from rlhf_core.output_lock import output_lock

LOCAL_SUFFIXES = (".jsonl", ".jsonl.gz", ".json", ".parquet")
PATH_STARTS = ("/", "./", "../", "~")


def is_local_source(source: str) -> bool:
    """Whether `source` names something on disk rather than a Hub dataset id (`name` or `namespace/name`).

    Local: it exists, is named like a preference file, starts like a path (`/`, `./`, `../`, `~`),
    has more separators than a Hub id can, or its parent directory exists here. So a mistyped local
    path is reported as a missing file, not looked up on the Hub.
    """
    path = Path(source).expanduser()
    if path.exists() or source.endswith(LOCAL_SUFFIXES) or source.startswith(PATH_STARTS):
        return True
    if source.count("/") > 1 or "\\" in source:
        return True
    return path.parent != Path(".") and path.parent.is_dir()


def resolve_sources(source: str, config: Config) -> list[Source]:
    """A local file, every preference file of a local directory (sorted, so the order is stable), or a
    Hub dataset id (with the configured data_dir and split); see `is_local_source`."""
    if not is_local_source(source):
        return [HubDataset(name=source, split=config.data.hub_split, data_dir=config.data.hub_data_dir)]
    path = Path(source).expanduser()
    if not path.exists():
        raise DataSourceError(
            f"input not found: {path} (a local path, so it was not looked up on the Hugging Face Hub; "
            "a Hub dataset id looks like namespace/name)"
        )
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.is_file() and p.name.endswith(LOCAL_SUFFIXES))
        if not files:
            raise DataSourceError(f"{path}: the directory holds no {', '.join(LOCAL_SUFFIXES)} files")
        return list(files)
    return [path]


def chat_token_lengths(tokenizer: PreTrainedTokenizerBase) -> TokenLengthFn:
    """Measure a pair as SFT and the reward model will tokenise it (chat template, end-of-turn)."""

    def token_length(pair: PreferencePair) -> TokenLengths:
        return TokenLengths(
            prompt=len(encode_prompt(tokenizer, pair.prompt)),
            prompt_and_chosen=len(encode_conversation(tokenizer, pair.prompt, pair.chosen).input_ids),
            prompt_and_rejected=len(encode_conversation(tokenizer, pair.prompt, pair.rejected).input_ids),
        )

    return token_length


def run_prepare_data(config: Config, out_dir: Path, source: str | None = None) -> DataReport:
    """Prepare the datasets into `out_dir` (atomically, holding its lock); `source` overrides `data.source`."""
    with output_lock(Path(out_dir), "prepare-data"):
        sources = resolve_sources(source or config.data.source, config)
        tokenizer = load_base_tokenizer(config.model)
        return prepare_preference_data(sources, Path(out_dir), config.data, chat_token_lengths(tokenizer))
