"""benchmarks/ppo_throughput.py on the tiny config: every figure present, positive and consistent.

The benchmark runs as a subprocess, as a user runs it (two measured iterations, no warm-up,
synthetic prompts). No timing is asserted, only the report's arithmetic: the phases add up to the
wall time, the token and sample counts follow from the settings, the FLOPs from the stated formula.
The prompt helpers are checked against the trainer's own encoding. (TRL's side needs its own
virtual environment and is not tested here.)
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from types import ModuleType
from typing import Any

import pytest

from fixtures.paths import ROOT, TINY
from rlhf_core.models.chat import encode_prompt
from rlhf_core.models.smollm2 import load_smollm2_tokenizer

BENCHMARKS = ROOT / "benchmarks"
BATCH, PROMPT, RESPONSE, ITERATIONS, EPOCHS, PEAK_TFLOPS = 4, 32, 8, 2, 2, 0.5


def load_benchmark_module(name: str) -> ModuleType:
    """A module of benchmarks/ (a folder of scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(f"benchmarks_{name}", BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their annotations through sys.modules
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("benchmark") / "report.json"
    command = [
        sys.executable, str(BENCHMARKS / "ppo_throughput.py"), "--config", str(TINY),
        "--iterations", str(ITERATIONS), "--warmup-iterations", "0", "--batch-size", str(BATCH),
        "--mini-batch-size", "2", "--micro-batch-size", "2", "--prompt-length", str(PROMPT),
        "--response-length", str(RESPONSE), "--ppo-epochs", str(EPOCHS), "--data", "synthetic",
        "--seed", "3", "--peak-tflops", str(PEAK_TFLOPS), "--json", str(out),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    completed = subprocess.run(command, check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert "samples/s" in completed.stdout and "FLOPs: model FLOPs per iteration" in completed.stdout
    return json.loads(out.read_text())


def test_report_has_every_figure_and_they_are_positive(report: dict[str, Any]) -> None:
    figures = [
        report["samples_per_s"],
        report["generated_tokens_per_s"],
        report["wall_s"],
        report["cpu_s"],
        report["samples_per_cpu_s"],
        *report["time_s"].values(),
        report["peak_memory_bytes"],
        report["peak_rss_process_bytes"],
        report["flops"]["model_flops"],
        report["flops"]["model_tflops_per_s"],
        report["flops"]["mfu"],
    ]
    assert all(isinstance(value, (int, float)) and value > 0 for value in figures), figures
    assert set(report["time_s"]) == {"generate", "score", "train", "other", "total"}
    assert "2*N*B*S" in report["flops"]["formula"] and "6*N*B*S" in report["flops"]["formula"]


def test_report_states_the_settings_it_ran(report: dict[str, Any]) -> None:
    settings = report["settings"]
    assert (settings["batch_size"], settings["prompt_length"], settings["response_length"]) == (BATCH, PROMPT, RESPONSE)
    assert (settings["mini_batch_size"], settings["micro_batch_size"], settings["ppo_epochs"]) == (2, 2, EPOCHS)
    assert (settings["model"], settings["device"], settings["seed"]) == ("tiny", "cpu", 3)
    assert settings["stop_token"] is None and settings["ptx_coef"] == 0.0
    assert report["resolved_config"]["ppo"]["critic_pretrain_steps"] == 0
    assert report["implementation"] == "rlhf_core" and len(report["prompt_fingerprint"]) == 16


def test_time_split_adds_up_to_the_wall_time(report: dict[str, Any]) -> None:
    times = report["time_s"]
    phases = times["generate"] + times["score"] + times["train"] + times["other"]
    assert phases == pytest.approx(times["total"], rel=1e-9)
    # The phases are summed per iteration, the wall time is one outer clock: only loop overhead differs.
    assert times["total"] == pytest.approx(report["wall_s"], rel=0.05, abs=0.05)
    assert sum(report["time_share"].values()) == pytest.approx(1.0)
    per_iteration = report["per_iteration"]
    assert len(per_iteration) == ITERATIONS == report["iterations"]
    assert sum(row["total_s"] for row in per_iteration) == pytest.approx(times["total"])


def test_counts_and_rates_follow_from_the_settings(report: dict[str, Any]) -> None:
    assert report["samples"] == BATCH * ITERATIONS
    assert report["generated_tokens"] == BATCH * RESPONSE * ITERATIONS
    assert report["samples_per_s"] == pytest.approx(report["samples"] / report["wall_s"])
    assert report["generated_tokens_per_s"] == pytest.approx(report["generated_tokens"] / report["wall_s"])
    assert report["samples_per_cpu_s"] == pytest.approx(report["samples"] / report["cpu_s"])


def test_flops_follow_the_stated_formula(report: dict[str, Any]) -> None:
    flops = report["flops"]
    params, tokens = flops["parameters"], BATCH * (PROMPT + RESPONSE)
    per_iteration = 2 * params * tokens + 4 * 2 * params * tokens + EPOCHS * 2 * 6 * params * tokens
    assert flops["model_flops"] == pytest.approx(per_iteration * ITERATIONS)
    assert flops["model_tflops_per_s"] == pytest.approx(flops["model_flops"] / report["wall_s"] / 1e12)
    assert flops["mfu"] == pytest.approx(flops["model_tflops_per_s"] / PEAK_TFLOPS)
    assert 3_000_000 < params < 3_500_000  # the tiny model: mostly its 49152 x 64 embedding


def test_peak_memory_is_the_measured_iterations_rss(report: dict[str, Any]) -> None:
    if report["peak_rss_iterations_bytes"] is None:
        pytest.skip("no /proc/self/clear_refs here: only the process peak is measured")
    assert report["peak_memory_bytes"] == report["peak_rss_iterations_bytes"]
    assert report["peak_memory_bytes"] <= report["peak_rss_process_bytes"]
    assert 0 <= report["rss_growth_iterations_bytes"] <= report["peak_memory_bytes"]


def test_benchmark_prompts_are_encoded_exactly_as_the_trainer_encodes_them() -> None:
    workload = load_benchmark_module("workload")
    tokenizer = load_smollm2_tokenizer()
    transcript = (
        "\n\nHuman: How do I bake bread at home?\n\nAssistant: Mix flour, water, salt and yeast."
        "\n\nHuman: How long should it rise?\n\nAssistant: About two hours, until doubled."
    )
    dialogue = workload.hh_dialogue(transcript)
    synthetic = workload.synthetic_prompts(tokenizer, count=3, length=40, seed=0)
    for prompt, length in [(dialogue, 30), *[(p, 40) for p in synthetic]]:
        ours = encode_prompt(tokenizer, prompt.messages, length)
        assert workload.encode_prompt_ids(tokenizer, prompt.messages, length) == ours
        assert len(ours) == length
    assert workload.synthetic_prompts(tokenizer, count=3, length=40, seed=0) == synthetic


def test_hh_transcripts_become_prompt_and_reply() -> None:
    workload = load_benchmark_module("workload")
    dialogue = workload.hh_dialogue("\n\nHuman: Hi there\n\nAssistant: Hello!\n\nHuman: Help me?\n\nAssistant: Sure.")
    assert dialogue.messages == [
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Help me?"},
    ]
    assert dialogue.reply == "Sure."
    assert workload.hh_dialogue("\n\nHuman: only a question") is None
    assert workload.hh_dialogue("\n\nAssistant: reply first\n\nHuman: then a question") is None
    assert workload.hh_dialogue("preamble\n\nHuman: Hi\n\nAssistant: Hello") is None
