"""rlhf_core/training/host_allocator.py: glibc keeps freed memory for the next tensor of a training step.

The behaviour is measured in a fresh interpreter per setting (the allocator's settings are per process):
the minor page faults of training steps of a small Llama with the tiny model's vocabulary, with glibc's
defaults and after `keep_freed_memory()`.
"""

import json
import os
import subprocess
import sys

import pytest

from fixtures.paths import ROOT
from rlhf_core.training.host_allocator import GLIBC_SETTINGS, keep_freed_memory, user_chose_allocator

STEPS = 8
MEASURED = 5  # the last steps, after the heap has grown to the step's working set
TRAINING_STEPS = f"""
import json, resource, sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
from rlhf_core.training.host_allocator import keep_freed_memory
torch.set_num_threads(1)
tuned = keep_freed_memory() if sys.argv[1] == "tuned" else False
torch.manual_seed(0)
config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
model = LlamaForCausalLM(config)
optimizer = torch.optim.AdamW(model.parameters())
ids = torch.randint(0, config.vocab_size, (2, 128), generator=torch.Generator().manual_seed(0))
faults = []
for _ in range({STEPS}):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({{"tuned": tuned, "faults": faults}}))
"""


def glibc() -> bool:
    return sys.platform.startswith("linux") and os.confstr("CS_GNU_LIBC_VERSION") is not None


def page_faults_per_step(mode: str) -> tuple[bool, list[int]]:
    environment = {name: value for name, value in os.environ.items() if not user_chose_allocator({name: value})}
    environment["OMP_NUM_THREADS"] = "1"
    result = subprocess.run(
        [sys.executable, "-c", TRAINING_STEPS, mode], capture_output=True, text=True, env=environment, check=True,
        cwd=ROOT,
    )  # fmt: skip
    record = json.loads(result.stdout.strip().splitlines()[-1])
    return record["tuned"], record["faults"][-MEASURED:]


def test_a_users_own_allocator_settings_are_left_alone() -> None:
    for name in GLIBC_SETTINGS:
        assert user_chose_allocator({name: "1"})
    assert user_chose_allocator({"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"})
    assert user_chose_allocator({"LD_PRELOAD": "libtcmalloc_minimal.so.4"})
    assert not user_chose_allocator({"LD_PRELOAD": "/usr/lib/libfaketime.so.1", "PATH": "/usr/bin"})
    assert not user_chose_allocator({})


def test_nothing_is_set_when_the_user_set_glibcs_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MALLOC_ARENA_MAX", "2")  # not an mmap or trim setting: not the user's choice of these
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "131072")
    assert keep_freed_memory() is False


@pytest.mark.slow
@pytest.mark.skipif(not glibc(), reason="glibc's malloc only")
def test_training_steps_stop_faulting_in_fresh_pages_once_freed_memory_is_kept() -> None:
    default_applied, default = page_faults_per_step("default")
    tuned_applied, tuned = page_faults_per_step("tuned")
    assert (default_applied, tuned_applied) == (False, True)
    # glibc's defaults: every step maps its 50 MB logits and their gradients afresh (mmap: above 32 MiB);
    # kept memory: the steps reuse the blocks the earlier steps freed.
    assert min(default) > 1000
    assert sorted(tuned)[MEASURED // 2] * 20 < sorted(default)[MEASURED // 2]
