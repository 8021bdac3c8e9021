"""The selected reward model's scores on every validation pair, as a table people can read.

One row per validation pair, in the order the pairs were scored: the prompt's last message, both replies,
r(x, y_chosen), r(x, y_rejected) and their margin (positive: ranked correctly), both replies' lengths in
the reward model's tokens (`reward.batch.reply_tokens`: the reply alone), with the file and line the
pair came from. The reward stage writes it as validation_pairs.jsonl beside metrics.json, and its
Prefect task publishes it as a table (tasks/stages/stage_reports.py).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from rlhf_core.atomic import atomic_write_text
from rlhf_core.data.records import PreferencePair
from rlhf_core.reward.batch import EncodedPairs, PairBatch, reply_tokens
from rlhf_core.reward.scoring import PairScores

VALIDATION_PAIRS_FILE = "validation_pairs.jsonl"


def validation_pair_rows(
    records: Sequence[PreferencePair], encoded: EncodedPairs, batches: Sequence[PairBatch], scores: PairScores
) -> list[dict[str, object]]:
    """The table's rows: `scores` are of `batches` in order, whose indices are positions among the encoded
    pairs `encoded.pairs`, and `encoded.kept[position]` is that pair's index in `records`."""
    positions = [position for batch in batches for position in batch.indices]
    rows = []
    for position, chosen, rejected in zip(positions, scores.chosen.tolist(), scores.rejected.tolist(), strict=True):
        record = records[encoded.kept[position]]
        rows.append(
            {
                "prompt": record.prompt[-1]["content"],
                "chosen": record.chosen,
                "rejected": record.rejected,
                "score_chosen": chosen,
                "score_rejected": rejected,
                "margin": chosen - rejected,
                "tokens_chosen": reply_tokens(encoded.pairs[position].chosen),
                "tokens_rejected": reply_tokens(encoded.pairs[position].rejected),
                "source": record.source,
                "line": record.line,
            }
        )
    return rows


def write_validation_pairs(out_dir: Path, rows: Sequence[dict[str, object]]) -> Path:
    """validation_pairs.jsonl in `out_dir`, written atomically."""
    text = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    return atomic_write_text(Path(out_dir) / VALIDATION_PAIRS_FILE, text)
