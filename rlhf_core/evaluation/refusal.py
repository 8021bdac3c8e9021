"""Why the promotion gate refused: one short paragraph from figures the pipeline already measured.

A refusal names the checks that failed; this says what limits the result and what would lift it. The
figures (each with its 95% interval where it has one):
- the policy reward model's and the judge's skill beyond length on their validation pairs: accuracy on
  length-matched pairs and the AUC the reward margin adds to length (rlhf_core/reward/length_metrics.py;
  metrics.json of the reward stage, `val/...`);
- how the policy reward model ranked the SFT policy's replies by length (`reward_length_spearman_sft` of
  the PPO run, rlhf_core/stages/ppo.py: the length the reward pays for);
- the evaluation's length ratio and its length-matched pairs' count and win minus loss.

The limit named is the first that the figures show, in the order the pipeline depends on them: a policy
reward model at chance on length-matched pairs (its interval reaches 0.5: PPO can learn only length from
it), then a judge at chance on them (it cannot show a gain beyond length), then too few length-matched
pairs in the evaluation (`MIN_LENGTH_MATCHED_PAIRS`). When none of these holds, the paragraph says the
evaluation measured no gain beyond length with reward models that can see one. A figure not measured is
shown as n/a and never names the limit.
"""

from __future__ import annotations

from collections.abc import Mapping

from pydantic import BaseModel

from rlhf_core.evaluation.report import MIN_LENGTH_MATCHED_PAIRS

CHANCE = 0.5


class Measured(BaseModel):
    """A figure and its 95% interval."""

    value: float
    low: float
    high: float

    def shown(self, signed: bool = False) -> str:
        """e.g. `0.55 (0.43-0.66)`, or signed `+0.01 (-0.02 to +0.04)`."""
        if signed:
            return f"{self.value:+.2f} ({self.low:+.2f} to {self.high:+.2f})"
        return f"{self.value:.2f} ({self.low:.2f}-{self.high:.2f})"


def measured(figures: Mapping[str, float], name: str) -> Measured | None:
    """`name` with its `_low` and `_high` from `figures`; None unless all three are there."""
    if not all(key in figures for key in (name, f"{name}_low", f"{name}_high")):
        return None
    return Measured(value=figures[name], low=figures[f"{name}_low"], high=figures[f"{name}_high"])


class RewardSkill(BaseModel):
    """A reward model's skill beyond length on its validation pairs (None: not measured)."""

    length_matched: Measured | None
    auc_gain: Measured | None

    @classmethod
    def from_metrics(cls, metrics: Mapping[str, float]) -> RewardSkill:
        """From a reward stage's metrics.json (or its MLflow run's `final.*` metrics, prefix removed)."""
        return cls(
            length_matched=measured(metrics, "val/length_matched_accuracy"),
            auc_gain=measured(metrics, "val/auc_gain_over_length"),
        )

    def shown(self) -> str:
        matched = "n/a" if self.length_matched is None else self.length_matched.shown()
        gain = "n/a" if self.auc_gain is None else self.auc_gain.shown(signed=True)
        return f"length-matched accuracy {matched}, AUC gain over length {gain}"

    @property
    def at_chance(self) -> bool:
        """Its length-matched accuracy's interval reaches chance (False when not measured)."""
        return self.length_matched is not None and self.length_matched.low <= CHANCE


class RefusalFigures(BaseModel):
    """What the explanation of a refusal is built from (see the module docstring)."""

    policy_reward: RewardSkill
    judge: RewardSkill | None  # None: the judge is not a reward model with its own validation (an LLM)
    sft_reward_length_spearman: float | None
    length_ratio: float | None
    length_matched_pairs: int | None
    length_matched_margin: Measured | None  # win minus loss on the length-matched pairs

    @classmethod
    def gather(
        cls,
        policy_reward: Mapping[str, float],
        judge: Mapping[str, float] | None,
        training: Mapping[str, float],
        evaluation: Mapping[str, float],
    ) -> RefusalFigures:
        """From the metrics of the policy reward model's and the judge's reward stages, the PPO run's and
        the evaluation's (empty mappings where a run is not known)."""
        pairs = evaluation.get("length_matched/pairs")
        return cls(
            policy_reward=RewardSkill.from_metrics(policy_reward),
            judge=None if judge is None else RewardSkill.from_metrics(judge),
            sft_reward_length_spearman=training.get("reward_length_spearman_sft"),
            length_ratio=evaluation.get("length_ratio"),
            length_matched_pairs=None if pairs is None else int(pairs),
            length_matched_margin=measured(evaluation, "length_matched/win_minus_loss"),
        )

    def limit(self) -> str:
        """The first limit the figures show (see the module docstring), worded as measured."""
        policy, judge = self.policy_reward, self.judge
        if policy.at_chance:
            assert policy.length_matched is not None
            return (
                f"the policy reward model ranks length-matched pairs at chance ({policy.length_matched.shown()}): "
                "PPO can learn little from it but length; more preference pairs or a larger base model are needed"
            )
        if judge is not None and judge.at_chance:
            assert judge.length_matched is not None
            return (
                f"the judge ranks length-matched pairs at chance ({judge.length_matched.shown()}): it cannot show "
                "a gain beyond length whatever the policy learned; a judge trained on more pairs is needed"
            )
        pairs = self.length_matched_pairs
        if pairs is not None and pairs < MIN_LENGTH_MATCHED_PAIRS:
            return (
                f"the evaluation judged {pairs} length-matched pairs, fewer than {MIN_LENGTH_MATCHED_PAIRS}: too "
                "few to show a gain beyond length; more evaluation prompts or replies per prompt are needed"
            )
        return (
            "the reward models' figures are not at chance and the evaluation had its length-matched pairs: it "
            "measured no gain beyond length that clears the gate"
        )

    def paragraph(self) -> str:
        """The paragraph under the failed checks: the limit, then the figures it was read from."""
        judge = "n/a (not a reward model)" if self.judge is None else self.judge.shown()
        spearman = "n/a" if self.sft_reward_length_spearman is None else f"{self.sft_reward_length_spearman:+.2f}"
        ratio = "n/a" if self.length_ratio is None else f"{self.length_ratio:.2f}"
        pairs = "n/a" if self.length_matched_pairs is None else str(self.length_matched_pairs)
        margin = "" if self.length_matched_margin is None else f", win - lose {self.length_matched_margin.shown(True)}"
        return (
            f"Why: {self.limit()}. Measured: policy reward model {self.policy_reward.shown()}; judge {judge}; "
            f"reward-length Spearman on the SFT policy's replies {spearman}; evaluation length ratio {ratio}, "
            f"{pairs} length-matched pairs{margin}."
        )
