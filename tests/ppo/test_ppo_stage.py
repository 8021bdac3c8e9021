"""The `ppo` stage on tiny SFT and reward-model outputs: every output, model loading, and exact resume after
a SIGKILL (the `rlhf ppo` command in a subprocess)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fixtures.commands import RLHF_COMMAND
from fixtures.paths import ROOT, TINY
from fixtures.tiny_ppo import StageInputs, tiny_config  # noqa: F401
from rlhf_core.data.prepare import load_split
from rlhf_core.models.heads import RewardModel
from rlhf_core.models.loading import load_causal_lm
from rlhf_core.stages.evaluate import run_evaluate
from rlhf_core.stages.ppo import copy_best_policy, load_ppo_models, run_ppo
from rlhf_core.stages.training_run import model_dir_sha256
from rlhf_core.training.checkpoint import complete_checkpoints

pytestmark = pytest.mark.usefixtures("one_thread")

RESUME_SETTINGS = ["-s", "ppo.steps=6", "-s", "ppo.checkpoint_every=2", "-s", "ppo.eval_every=3"]


def history(out: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in (out / "history.jsonl").read_text().splitlines()]


def test_stage_writes_every_output_and_a_rerun_changes_nothing(inputs: StageInputs, tmp_path: Path) -> None:
    config = tiny_config("ppo.keep_checkpoints=1")
    out = tmp_path / "ppo"
    result = run_ppo(config, inputs.data_dir, inputs.sft_dir, inputs.rm_dir, out)
    total = config.ppo.critic_pretrain_steps + config.ppo.steps
    rows = history(out)
    assert [row["step"] for row in rows] == list(range(total + 1))  # step 0 validates the SFT policy
    assert rows[-1]["progress"] == 1.0 and "val/reward" in rows[-1]
    assert {"reward/score_mean", "kl/token_k3", "loss/value", "time/generate_s", "time/train_s"} <= set(rows[-1])
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert {row["step"] for row in samples} == set(range(2, total + 1, config.ppo.sample_table_every))
    assert {"prompt", "response", "score", "finished"} <= set(samples[0])
    for name in ("reward", "kl", "perplexity", "response_length"):
        assert (out / "plots" / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics == result.metrics and metrics["steps_completed"] == total and metrics["guard_stopped"] == 0
    assert metrics["guard_enabled"] == 1.0  # the default guard has bounds: its "not stopped" means something
    assert metrics["val/reward_initial"] == rows[0]["val/reward"]
    # The reward's rank correlation with length on the SFT policy's replies: every rollout before the first
    # policy update (critic pretraining's and the next), averaged, where defined.
    sft_rollouts = [
        row["reward/length_spearman"]
        for row in rows[1 : int(metrics["critic_pretrain_steps"]) + 2]
        if "reward/length_spearman" in row
    ]
    assert metrics.get("reward_length_spearman_sft") == (
        pytest.approx(sum(sft_rollouts) / len(sft_rollouts)) if sft_rollouts else None
    )
    assert metrics.get("reward_length_spearman_sft_rollouts", 0) == len(sft_rollouts)
    assert [path.name for path in complete_checkpoints(out / "checkpoints")] == [f"step-{total:08d}"]
    model, tokenizer = load_causal_lm(out / "model")
    assert model.generation_config.eos_token_id == [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    assert tokenizer.chat_template is not None
    assert (
        load_file(out / "model" / "model.safetensors").keys()
        == load_file(out / "checkpoints" / "best" / "model.safetensors").keys()
    )

    rerun = run_ppo(config, inputs.data_dir, inputs.sft_dir, inputs.rm_dir, out)  # resumes at the end
    assert history(out) == rows
    assert metrics["resumed_from"] == 0 and rerun.metrics["resumed_from"] == total
    invocation = {"wall_time_s", "resumed_from"}  # what differs between the two invocations
    assert {k: v for k, v in rerun.metrics.items() if k not in invocation} == {
        k: v for k, v in metrics.items() if k not in invocation
    }


def test_validation_prompts_are_held_out_of_training_and_of_the_evaluation(inputs: StageInputs, tmp_path: Path) -> None:
    """On the prompt ids each stage read: PPO's validation (selection.json), PPO's training prompts and
    the evaluate stage's generations (every eval prompt)."""
    config = tiny_config("ppo.steps=2", "evaluation.generation.max_new_tokens=4")
    run_ppo(config, inputs.data_dir, inputs.sft_dir, inputs.rm_dir, tmp_path / "ppo")
    selection = json.loads((tmp_path / "ppo" / "selection.json").read_text())
    validated = set(selection["prompt_ids"])
    assert len(validated) == len(selection["validations"][0]["rewards"]) >= 2
    trained = {prompt.prompt_id for prompt in load_split(inputs.data_dir, "ppo_prompts")}
    run_evaluate(config, inputs.data_dir, tmp_path / "ppo", inputs.sft_dir, tmp_path / "eval", rm_dir=inputs.rm_dir)
    evaluated = {
        json.loads(line)["prompt_id"] for line in (tmp_path / "eval" / "generations.jsonl").read_text().splitlines()
    }
    assert evaluated and trained
    assert not validated & evaluated and not validated & trained and not trained & evaluated
    report = (tmp_path / "eval" / "report.md").read_text()  # the PPO run's evidence beside the verdicts
    gain = selection["gain_over_initial"]
    assert "## The PPO run behind model A" in report
    assert f"(95% interval {gain['low']:+.4g} to {gain['high']:+.4g})" in report and "validation_gain.png" in report


@pytest.mark.parametrize("critic_init", ["reward", "sft"])
def test_models_are_initialised_as_the_paper_says(inputs: StageInputs, critic_init: str) -> None:
    models, _ = load_ppo_models(
        tiny_config(f"ppo.critic_init={critic_init}"), inputs.sft_dir, inputs.rm_dir, torch.device("cpu")
    )
    sft, _ = load_causal_lm(inputs.sft_dir / "model")
    reward_model = RewardModel.from_pretrained(inputs.rm_dir / "model")
    for name, tensor in sft.state_dict().items():
        assert torch.equal(models.policy.state_dict()[name], tensor)
        assert torch.equal(models.reference.state_dict()[name], tensor)
    source = reward_model if critic_init == "reward" else sft.base_model
    backbone = source.backbone if critic_init == "reward" else source
    for name, tensor in backbone.state_dict().items():
        assert torch.equal(models.critic.backbone.state_dict()[name], tensor), name
    head = models.critic.value_head
    assert head.bias is not None
    if critic_init == "reward":  # the reward model's head, bias included
        assert torch.equal(head.weight, reward_model.score_head.weight)
        assert torch.equal(head.bias, reward_model.score_head.bias)
    else:
        assert not torch.equal(head.weight, reward_model.score_head.weight)
    assert not any(p.requires_grad for p in models.scorer.reward_model.parameters())


def test_unfinished_inputs_are_refused(inputs: StageInputs, tmp_path: Path) -> None:
    unfinished = tmp_path / "reward"
    unfinished.mkdir()
    with pytest.raises(FileNotFoundError, match="not a completed stage output"):
        run_ppo(tiny_config(), inputs.data_dir, inputs.sft_dir, unfinished, tmp_path / "ppo")


@pytest.mark.parametrize("chosen_step", [0, 3])
def test_the_start_is_handed_on_as_the_sft_models_own_files(tmp_path: Path, chosen_step: int) -> None:
    """Step 0 hands on the SFT model's bytes (so it hashes as the SFT model, even where a re-save would
    differ); a later step hands on checkpoints/best/."""
    sft_model, best = tmp_path / "sft" / "model", tmp_path / "checkpoints" / "best"
    for directory, weights in ((sft_model, b"sft weights"), (best, b"re-saved weights")):
        directory.mkdir(parents=True)
        (directory / "model.safetensors").write_bytes(weights)
    copy_best_policy(tmp_path / "checkpoints", tmp_path / "model", chosen_step, sft_model)
    handed_on = sft_model if chosen_step == 0 else best
    assert model_dir_sha256(tmp_path / "model") == model_dir_sha256(handed_on)


def rlhf_ppo(inputs: StageInputs, out: Path) -> subprocess.Popen[str]:
    command = [
        *RLHF_COMMAND,
        "ppo",
        "-c",
        str(TINY),
        "--data-dir",
        str(inputs.data_dir),
        "--sft-dir",
        str(inputs.sft_dir),
        "--rm-dir",
        str(inputs.rm_dir),
        "--out",
        str(out),
        *RESUME_SETTINGS,
    ]
    return subprocess.Popen(
        command,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def finish(process: subprocess.Popen[str]) -> str:
    stdout, stderr = process.communicate(timeout=300)
    assert process.returncode == 0, stderr
    return stdout


def kill_after_step(process: subprocess.Popen[str], out: Path, step: int, delay: float) -> None:
    """SIGKILL `process` `delay` seconds after its history.jsonl reaches `step`."""
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and process.poll() is None:
        if (out / "history.jsonl").is_file() and any(row["step"] >= step for row in history(out)):
            break
        time.sleep(0.05)
    time.sleep(delay)
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=30)


@pytest.mark.slow
def test_rerun_after_sigkill_resumes_exactly(inputs: StageInputs, tmp_path: Path) -> None:
    """No step twice in the history, and the same final weights and monitors as an uninterrupted run."""
    rng = random.Random(4)
    uninterrupted, interrupted = tmp_path / "uninterrupted", tmp_path / "interrupted"
    reference = rlhf_ppo(inputs, uninterrupted)
    victim = rlhf_ppo(inputs, interrupted)
    kill_after_step(victim, interrupted, step=rng.randint(3, 5), delay=rng.uniform(0.0, 0.5))
    assert victim.returncode == -signal.SIGKILL
    assert not (interrupted / "metrics.json").exists()
    saved_steps = [int(path.name.removeprefix("step-")) for path in complete_checkpoints(interrupted / "checkpoints")]
    assert saved_steps and 2 <= max(saved_steps) < 7  # the rerun resumes from the middle of the run
    finish(reference)
    assert "best policy at step" in finish(rlhf_ppo(inputs, interrupted))

    expected, resumed = history(uninterrupted), history(interrupted)
    assert [row["step"] for row in resumed] == [row["step"] for row in expected] == list(range(8))
    for before, after in zip(expected, resumed):
        assert {k: v for k, v in before.items() if not k.startswith("time/")} == {
            k: v for k, v in after.items() if not k.startswith("time/")
        }
    for relative in ("model/model.safetensors", "checkpoints/step-00000007/model.safetensors"):
        a, b = load_file(uninterrupted / relative), load_file(interrupted / relative)
        assert a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a), relative
    samples = [json.loads(line)["step"] for line in (interrupted / "samples.jsonl").read_text().splitlines()]
    assert samples == [json.loads(line)["step"] for line in (uninterrupted / "samples.jsonl").read_text().splitlines()]
