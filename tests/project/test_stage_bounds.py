"""benchmarks/stage_flops.py and the pure parts of stage_tokens.py / stage_bounds.py against hand-computed
figures on a tiny shape (hidden 8, MLP 16, 2 blocks, 2 heads of 4 over 1 kv head, vocabulary 10). No timing."""

from __future__ import annotations

from types import ModuleType

import pytest

from fixtures.benchmarks import import_benchmark

TINY_CONFIG = {
    "hidden_size": 8,
    "intermediate_size": 16,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "vocab_size": 10,
}
SMOLLM2_CONFIG = {
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "vocab_size": 49152,
}


@pytest.fixture
def flops(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    return import_benchmark(monkeypatch, "stage_flops")


def test_shape_counts_matmul_parameters(flops: ModuleType) -> None:
    tiny = flops.ModelShape.from_config(TINY_CONFIG)
    # q, o: 8 x 8 each; k, v: 8 x 4 each; gate, up, down: 8 x 16 each
    assert tiny.block_parameters == 64 + 64 + 32 + 32 + 3 * 128
    assert tiny.matmul_parameters == 2 * 576 + 80
    assert tiny.weight_bytes == 4 * 1232
    smollm2 = flops.ModelShape.from_config(SMOLLM2_CONFIG)
    assert smollm2.matmul_parameters == 134_479_872  # 30 blocks of 3,538,944 and the 49152 x 576 head


def test_padded_training_batch(flops: ModuleType) -> None:
    tiny = flops.ModelShape.from_config(TINY_CONFIG)
    # one block, 2 rows x 3 columns: matmuls 2 * 576 * 6 = 6912, attention 4 * 2 * 4 * 2 * 3 * 3 = 576
    assert flops.forward_flops(tiny, 2, 3, 1) == 7488
    work = flops.batch_pass(tiny, [3, 2], blocks=2, head_positions=3, trained_blocks=1)
    # forward through both blocks 2 * 7488, the top block's backward 2 * 7488, the head at 3 targets
    # forward and input gradient 2 * 2 * 80 * 3
    assert work.flops == 2 * 7488 + 2 * 7488 + 960
    assert (work.real_tokens, work.padded_tokens) == (5, 6)


def test_cached_lower_blocks_run_each_sequence_unpadded(flops: ModuleType) -> None:
    tiny = flops.ModelShape.from_config(TINY_CONFIG)
    work = flops.cached_lower_pass(tiny, [3, 2], blocks=1)
    # 3 tokens: 2 * 576 * 3 + 4 * 8 * 3 * 3; 2 tokens: 2 * 576 * 2 + 4 * 8 * 2 * 2
    assert work.flops == 3744 + 2432
    assert work.real_tokens == work.padded_tokens == 5


def test_generation_and_its_bound(flops: ModuleType) -> None:
    tiny = flops.ModelShape.from_config(TINY_CONFIG)
    work = flops.generation(tiny, rows=2, prompt_width=3, steps=3, real_tokens=8)
    prefill = 2 * 7488 + 2 * 80 * 2  # both blocks over 2 x 3 prompt columns, the head at each row's last
    decode = [2 * 1232 * 2 + 2 * 4 * 8 * 2 * context for context in (4, 5)]  # steps over 4 and 5 cached columns
    assert work.flops == prefill + sum(decode)
    assert (work.decode_steps, work.decode_flops, work.padded_tokens) == (2, sum(decode), 12)
    # at 1 GFLOP/s and 1 kB/s each decode step is bound by streaming the 4928 bytes of weights
    assert work.bound_seconds(1.0, 1e-6, tiny.weight_bytes) == pytest.approx(prefill / 1e9 + 2 * 4.928)
    assert work.bound_seconds(1.0, 1e6, tiny.weight_bytes) == pytest.approx(work.flops / 1e9)


def test_works_add_up(flops: ModuleType) -> None:
    one = flops.Work(real_tokens=1, padded_tokens=2, flops=3.0, decode_steps=4, decode_flops=1.0)
    assert flops.total([one, one, one]) == flops.Work(3, 6, 9.0, 12, 3.0)


def test_validation_schedule_and_decode_length(monkeypatch: pytest.MonkeyPatch) -> None:
    tokens = import_benchmark(monkeypatch, "stage_tokens")
    assert tokens.validation_batch_counts(93, 50, 8, 42) == [8, 42]  # SFT: step 50 on 8 batches, then all
    assert tokens.validation_batch_counts(53, 50, 100, 95) == [95, 95]
    assert tokens.validation_batch_counts(40, None, 8, 10) == [10]
    assert tokens.decode_length({"response/finished_fraction": 0.5, "response/length_mean": 20.0}, 64) == 64
    assert tokens.decode_length({"response/finished_fraction": 1.0, "response/length_mean": 20.2}, 64) == 21


def test_largest_gap_is_in_minutes(monkeypatch: pytest.MonkeyPatch) -> None:
    bounds = import_benchmark(monkeypatch, "stage_bounds")
    work = bounds.Work(real_tokens=1, padded_tokens=1, flops=1.0)
    rows = [
        bounds.StageBound("fast", work, bound_minutes=1.0, measured_minutes=20.0),  # 20x, 19 min over
        bounds.StageBound("slow", work, bound_minutes=10.0, measured_minutes=40.0),  # 4x, 30 min over
        bounds.StageBound("unmeasured", work, bound_minutes=1.0, measured_minutes=None),
    ]
    assert bounds.largest_gap(rows).stage == "slow"
    assert rows[0].ratio == 20.0
