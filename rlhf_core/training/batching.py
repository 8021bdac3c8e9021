"""Deterministic, resumable batch plans: optimizer step k -> its micro-batches of example indices.

A plan is a pure function of (dataset size or token lengths, seed, batch shape). `plan.step(k)` returns
the micro-batches of the 0-based optimizer step `k` for any `k`, with `epoch = k // steps_per_epoch` and a
fresh seeded order in every epoch. The position in the data stream is therefore just the global step
number: a resumed run asks for `plan.step(k + 1)` and needs no iterator state.

Three ways to form micro-batches:

* fixed size (`fixed_size_plan`): every epoch shuffles the examples with a generator seeded by
  `(seed, epoch)` and cuts the permutation into micro-batches of `micro_batch_size`.
* length-grouped (`length_grouped_plan`): as fixed size, but every epoch's shuffled examples are cut into
  groups of LENGTH_GROUP_MICRO_BATCHES micro-batches, each group sorted by length and cut into
  micro-batches, and the micro-batches shuffled. Micro-batches keep `micro_batch_size` examples and the
  epoch its steps, but a micro-batch's examples have similar lengths, so little of its padded width is
  padding (transformers' `group_by_length` does the same; 38% of a default SFT run's padded token
  passes were padding with fixed-size batches: docs/stage-bounds.md). The examples of the last group's incomplete
  micro-batch (its longest) are the ones an epoch drops.
* token budget (`token_budget_plan`, the paper's dynamic batching): examples are sorted by length and
  packed greedily so that `max_len_in_batch * batch_size <= token_budget` (the padded size of the
  micro-batch). The packing is done once, so similar lengths share a micro-batch and little padding is
  wasted; every epoch shuffles the order of the micro-batches (the scheme of fairseq's `batch_by_size`).
  Micro-batches then hold different numbers of examples, which is why losses are normalised by the
  unit count of the whole optimizer step (see `loop.py`).

Incomplete last step: each epoch uses `steps_per_epoch * accumulation_steps` micro-batches and drops the
rest (at most `accumulation_steps - 1` micro-batches, plus in fixed mode fewer than `micro_batch_size`
examples), so every optimizer step has the same number of micro-batches. The order changes every epoch,
so different examples are dropped each time.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from rlhf_core.config.training import Batching

MicroBatch = list[int]
LENGTH_GROUP_MICRO_BATCHES = 50  # micro-batches per length group (transformers' LengthGroupedSampler: 50 too)


@dataclass(frozen=True)
class BatchPlan:
    """Which examples each optimizer step uses; build it with `fixed_size_plan`, `length_grouped_plan` or
    `token_budget_plan` (or `batch_plan`, which picks one by name).

    Exactly one of `micro_batch_size` (fixed-size batching; length-grouped when `lengths` is set too) and
    `packed_micro_batches` (token-budget batching, the micro-batches in packing order) is set.
    """

    num_examples: int
    seed: int
    accumulation_steps: int
    micro_batch_size: int | None = None
    packed_micro_batches: tuple[tuple[int, ...], ...] | None = None
    lengths: tuple[int, ...] | None = None  # each example's length, to group by (length-grouped plans only)

    def __post_init__(self) -> None:
        if (self.micro_batch_size is None) == (self.packed_micro_batches is None):
            raise ValueError("set exactly one of micro_batch_size and packed_micro_batches")
        if self.lengths is not None and (self.micro_batch_size is None or len(self.lengths) != self.num_examples):
            raise ValueError("lengths need micro_batch_size and one length per example")
        if self.accumulation_steps < 1:
            raise ValueError(f"accumulation_steps must be >= 1, got {self.accumulation_steps}")
        if self.micro_batch_size is not None and self.micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {self.micro_batch_size}")
        if self.steps_per_epoch < 1:
            raise ValueError(
                f"the plan has no complete optimizer step: {self._micro_batches_per_epoch()} micro-batches "
                f"per epoch from {self.num_examples} examples, {self.accumulation_steps} needed per step"
            )

    def _micro_batches_per_epoch(self) -> int:
        if self.packed_micro_batches is not None:
            return len(self.packed_micro_batches)
        assert self.micro_batch_size is not None
        return self.num_examples // self.micro_batch_size

    @property
    def steps_per_epoch(self) -> int:
        """Optimizer steps in one epoch (the incomplete last step is dropped)."""
        return self._micro_batches_per_epoch() // self.accumulation_steps

    def epoch_micro_batches(self, epoch: int) -> list[MicroBatch]:
        """All micro-batches used in `epoch`, in training order (`steps_per_epoch * accumulation_steps`)."""
        rng = np.random.default_rng([self.seed, epoch])
        used = self.steps_per_epoch * self.accumulation_steps
        if self.packed_micro_batches is not None:
            order = rng.permutation(len(self.packed_micro_batches))[:used]
            return [list(self.packed_micro_batches[i]) for i in order]
        assert self.micro_batch_size is not None
        examples = rng.permutation(self.num_examples).tolist()
        size = self.micro_batch_size
        if self.lengths is not None:
            return self._grouped_by_length(examples, rng)[:used]
        return [examples[i * size : (i + 1) * size] for i in range(used)]

    def _grouped_by_length(self, examples: list[int], rng: np.random.Generator) -> list[MicroBatch]:
        """`examples` (the epoch's permutation) cut into groups, each sorted by length (ties in permutation
        order) and cut into full micro-batches, then every micro-batch in a seeded random order."""
        assert self.micro_batch_size is not None and self.lengths is not None
        size, lengths = self.micro_batch_size, self.lengths
        group_size = size * LENGTH_GROUP_MICRO_BATCHES
        micro_batches: list[MicroBatch] = []
        for start in range(0, len(examples), group_size):
            group = sorted(examples[start : start + group_size], key=lambda index: lengths[index])
            micro_batches += [group[i : i + size] for i in range(0, len(group) - size + 1, size)]
        return [micro_batches[i] for i in rng.permutation(len(micro_batches))]

    def step(self, k: int) -> list[MicroBatch]:
        """The micro-batches of 0-based optimizer step `k` (epoch `k // steps_per_epoch`)."""
        if k < 0:
            raise ValueError(f"step index must be >= 0, got {k}")
        epoch, index = divmod(k, self.steps_per_epoch)
        micro_batches = self.epoch_micro_batches(epoch)
        first = index * self.accumulation_steps
        return micro_batches[first : first + self.accumulation_steps]


def fixed_size_plan(num_examples: int, seed: int, micro_batch_size: int, accumulation_steps: int) -> BatchPlan:
    """A plan whose micro-batches all hold `micro_batch_size` examples."""
    return BatchPlan(
        num_examples=num_examples, seed=seed, accumulation_steps=accumulation_steps, micro_batch_size=micro_batch_size
    )


def length_grouped_plan(lengths: Sequence[int], seed: int, micro_batch_size: int, accumulation_steps: int) -> BatchPlan:
    """A plan of `micro_batch_size` examples per micro-batch, each of similar lengths (module docstring)."""
    return BatchPlan(
        num_examples=len(lengths),
        seed=seed,
        accumulation_steps=accumulation_steps,
        micro_batch_size=micro_batch_size,
        lengths=tuple(lengths),
    )


def pack_by_token_budget(lengths: Sequence[int], seed: int, token_budget: int) -> list[MicroBatch]:
    """Greedy length-sorted packing: each micro-batch satisfies `max_len * batch_size <= token_budget`.

    Examples are sorted by length (ties in a seeded random order), so adding an example to the current
    micro-batch raises its padded size to `length * (size + 1)`; when that exceeds the budget the
    micro-batch is closed. Raises `ValueError` for an example longer than the budget by itself.
    """
    for index, length in enumerate(lengths):
        if length > token_budget:
            raise ValueError(
                f"example {index} has {length} tokens, more than the token budget {token_budget}; "
                "truncate examples to at most the budget first"
            )
    tie_break = np.random.default_rng(seed).permutation(len(lengths))
    order = sorted(tie_break.tolist(), key=lambda i: lengths[i])
    micro_batches: list[MicroBatch] = []
    current: MicroBatch = []
    for index in order:
        if current and lengths[index] * (len(current) + 1) > token_budget:
            micro_batches.append(current)
            current = []
        current.append(index)
    if current:
        micro_batches.append(current)
    return micro_batches


def token_budget_plan(lengths: Sequence[int], seed: int, token_budget: int, accumulation_steps: int) -> BatchPlan:
    """A dynamic-batching plan: micro-batches packed up to `token_budget` padded tokens each."""
    packed = pack_by_token_budget(lengths, seed, token_budget)
    return BatchPlan(
        num_examples=len(lengths),
        seed=seed,
        accumulation_steps=accumulation_steps,
        packed_micro_batches=tuple(tuple(batch) for batch in packed),
    )


def batch_plan(
    batching: Batching,
    lengths: Sequence[int],
    seed: int,
    *,
    micro_batch_size: int,
    token_budget: int,
    accumulation_steps: int,
) -> BatchPlan:
    """The plan a training stage's `batching` setting names, over examples of `lengths` tokens
    (`micro_batch_size` is not used by token-budget plans, `token_budget` only by them)."""
    if batching == "fixed":
        return fixed_size_plan(len(lengths), seed, micro_batch_size, accumulation_steps)
    if batching == "length_grouped":
        return length_grouped_plan(lengths, seed, micro_batch_size, accumulation_steps)
    return token_budget_plan(lengths, seed, token_budget, accumulation_steps)
