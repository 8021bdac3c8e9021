"""The judge's view of an evaluation: the pairs it is asked about, its verdicts on each kind, and the
verdict files (rlhf_core/stages/evaluate.py runs them; outputs.py holds the file formats)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from rlhf_core.evaluation.judges.verdicts import Judge, Judgement
from rlhf_core.evaluation.outputs import (
    ANCHOR_VERDICTS_FILE,
    MATCHED_VERDICTS_FILE,
    SAMPLE_VERDICTS_FILE,
    VERDICTS_FILE,
    GeneratedPair,
    verdict_rows,
    write_jsonl,
)
from rlhf_core.evaluation.report import JudgedPair


@dataclass(frozen=True)
class GeneratedPairs:
    """What the judge is asked about: the main pair of each prompt, the length-matched pairs, the further
    same-index pairs of the length-controlled win rate and its anchor pairs (B against B)."""

    main: list[GeneratedPair]
    matched: list[GeneratedPair]
    samples: list[GeneratedPair]
    anchors: list[GeneratedPair]

    def by_prompt(self, *kinds: tuple[Sequence[GeneratedPair], Sequence[JudgedPair]]) -> list[list[JudgedPair]]:
        """Per prompt (in the main pairs' order), its judged pairs of each of `kinds` (generated, judged) in turn."""
        groups: dict[str, list[JudgedPair]] = {item.pair.prompt_id: [] for item in self.main}
        for generated, judged in kinds:
            for item, pair in zip(generated, judged, strict=True):
                groups[item.pair.prompt_id].append(pair)
        return list(groups.values())


def judged_pairs(generated: Sequence[GeneratedPair], judgements: Sequence[Judgement]) -> list[JudgedPair]:
    """The report's view of each judged pair."""
    return [
        JudgedPair(
            item.pair.pair_key,
            item.pair.category,
            item.tokens_a,
            item.tokens_b,
            judgement.verdict,
            judgement.score_diff,
            judgement.score_b,
        )
        for item, judgement in zip(generated, judgements)
    ]


@dataclass(frozen=True)
class Judgements:
    """The judge's verdicts on each kind of pair of `GeneratedPairs`, in the same order."""

    main: list[Judgement]
    matched: list[Judgement]
    samples: list[Judgement]
    anchors: list[Judgement]


def judge_pairs(judge: Judge, generated: GeneratedPairs, out_dir: Path) -> Judgements:
    """The verdicts on the main, the length-matched, the sample and the anchor pairs, written to
    verdicts.jsonl, verdicts_matched.jsonl, verdicts_samples.jsonl and verdicts_anchors.jsonl. One call, and
    a pair that is both (a length-matched pair that is a prompt's main or sample pair) is judged once, so no
    reply is scored (and no LLM request sent) twice."""
    kinds = (generated.main, generated.matched, generated.samples, generated.anchors)
    asked = list({item.pair.pair_key: item.pair for pairs in kinds for item in pairs}.values())
    by_key = dict(zip([pair.pair_key for pair in asked], judge.judge(asked)))
    judgements = Judgements(*([by_key[item.pair.pair_key] for item in pairs] for pairs in kinds))
    name = judge.info().name
    write_jsonl(out_dir / VERDICTS_FILE, verdict_rows(generated.main, judgements.main, name))
    write_jsonl(out_dir / MATCHED_VERDICTS_FILE, verdict_rows(generated.matched, judgements.matched, name))
    write_jsonl(out_dir / SAMPLE_VERDICTS_FILE, verdict_rows(generated.samples, judgements.samples, name))
    write_jsonl(out_dir / ANCHOR_VERDICTS_FILE, verdict_rows(generated.anchors, judgements.anchors, name))
    return judgements
