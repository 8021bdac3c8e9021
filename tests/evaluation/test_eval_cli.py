"""`rlhf eval` on tiny model directories (no SFT or reward-model training needed).

The command runs in this process through the console entry point `rlhf_cli.main.main` (argument
parsing, one-line errors, exit status), which saves a fresh interpreter's torch import per case.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fixtures.commands import RLHF_COMMAND
from fixtures.library_output import library_output, without_quiet_switches
from fixtures.paths import PARAMS, ROOT, TINY
from rlhf_cli.exit_codes import REFUSED_EXIT_CODE
from rlhf_cli.main import main
from rlhf_cli.quiet_libraries import QUIET_LIBRARY_SETTINGS
from rlhf_core.config import load_config
from rlhf_core.evaluation.length_control import AnchorRows, length_controlled_win_rate
from rlhf_core.models.chat import end_of_turn_id
from rlhf_core.models.heads import RewardModel
from rlhf_core.models.saving import save_causal_lm
from rlhf_core.models.tiny import build_tiny_model, load_tiny_model
from rlhf_core.reward.training_data import training_data_record, write_training_data
from rlhf_core.stages.prepare_data import run_prepare_data
from rlhf_core.stages.result import write_metrics

JUDGE_VARIABLES = ("RLHF_JUDGE_API_KEY", "OPENAI_API_KEY", "RLHF_JUDGE_BASE_URL", "OPENAI_BASE_URL")


@pytest.fixture()
def rlhf(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]):
    """Run `rlhf ARGS...` in the repository root; returns (exit status, stdout, stderr). The command
    switches the libraries' bars off (stderr is captured, not a terminal) in the environment, which
    monkeypatch restores after the test."""
    monkeypatch.chdir(ROOT)
    for name, value in QUIET_LIBRARY_SETTINGS.items():
        monkeypatch.setenv(name, value)

    def run(*args: str) -> tuple[int, str, str]:
        monkeypatch.setattr(sys, "argv", ["rlhf", *args])
        with pytest.raises(SystemExit) as exit_info:
            main()
        captured = capsys.readouterr()
        return exit_info.value.code or 0, captured.out, captured.err

    return run


def hh_row(i: int, topic: str) -> str:
    prompt = f"\n\nHuman: Tell me about {topic} number {i}."
    return json.dumps(
        {"chosen": f"{prompt}\n\nAssistant: {topic} {i} is fine.", "rejected": f"{prompt}\n\nAssistant: No."}
    )


@pytest.fixture(scope="module")
def eval_inputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Prepared data from two source files (two categories), two tiny LMs and a tiny reward model."""
    root = tmp_path_factory.mktemp("eval-inputs")
    raw = root / "raw"
    raw.mkdir()
    (raw / "harmless-base.jsonl").write_text("".join(hh_row(i, "safety") + "\n" for i in range(30)))
    (raw / "helpful-base.jsonl").write_text("".join(hh_row(i, "gardening") + "\n" for i in range(30, 60)))
    config = load_config(PARAMS, overlays=[TINY], overrides=["data.eval_fraction=0.3"])
    run_prepare_data(config, root / "data", source=str(raw))
    tokenizer = load_tiny_model()[1]
    for name, seed in (("ppo", 0), ("sft", 1)):
        save_causal_lm(build_tiny_model(tokenizer, seed=seed), tokenizer, root / name / "model")
        write_metrics(root / name, {"steps": 0.0})
    reward_model = RewardModel.from_causal_lm(build_tiny_model(tokenizer, seed=2), end_of_turn_id(tokenizer))
    reward_model.save_pretrained(root / "reward" / "model", tokenizer)
    write_metrics(root / "reward", {"steps": 0.0})
    return {name: root / name for name in ("data", "ppo", "sft", "reward")}


EVAL_FILES = {
    "generations.jsonl",
    "verdicts.jsonl",
    "generations_matched.jsonl",
    "verdicts_matched.jsonl",
    "generations_samples.jsonl",
    "verdicts_samples.jsonl",
    "generations_anchors.jsonl",
    "verdicts_anchors.jsonl",
    "report.json",
    "report.md",
    "plots/win_rate.png",
    "metrics.json",
}
PREFERENCE = {"A": 1.0, "tie": 0.5, "B": 0.0}


def eval_tiny(
    rlhf, eval_inputs: dict[str, Path], out: Path, *options: str, a: Path | None = None, b: Path | None = None
) -> tuple[int, str, str]:
    """`rlhf eval` of model `a` (default: the tiny PPO output) against `b` (default: its SFT model), judged
    by the tiny reward model, on 6 prompts of at most 6 tokens."""
    a, b = a or eval_inputs["ppo"], b or eval_inputs["sft"]
    models = ["--a", str(a), "--b", str(b), "--rm-dir", str(eval_inputs["reward"])]
    settings = ["-s", "evaluation.max_prompts=6", "-s", "evaluation.generation.max_new_tokens=6"]
    data = ["--data-dir", str(eval_inputs["data"]), "-c", str(TINY)]
    return rlhf("eval", *models, *data, *settings, *options, "--out", str(out))


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def check_length_controlled(out: Path, generations: list[dict], verdicts: list[dict], metrics: dict) -> None:
    """tiny.yaml draws 2 replies per prompt and model, so the length-controlled win rate is fitted on the main
    pair and the second replies' pair of each prompt, with B's two replies against each other as the anchor
    rows, resampled by prompt: as the plain reference fit on the written verdicts gives it."""
    samples = read_rows(out / "generations_samples.jsonl")
    sample_verdicts = read_rows(out / "verdicts_samples.jsonl")
    assert [(row["prompt_id"], row["sample"]) for row in samples] == [(g["prompt_id"], 1) for g in generations]
    assert [v["pair_key"] for v in sample_verdicts] != [v["pair_key"] for v in verdicts]
    assert (metrics["lc_pairs"], metrics["lc_prompts"]) == (12, 6)
    pairs = verdicts + sample_verdicts
    anchors = read_rows(out / "verdicts_anchors.jsonl")
    anchor_rows = read_rows(out / "generations_anchors.jsonl")
    expected_anchors = [(g["prompt_id"], 0, 1) for g in generations]
    assert [(row["prompt_id"], row["sample_a"], row["sample_b"]) for row in anchor_rows] == expected_anchors
    assert [row["reply_a"] for row in anchor_rows] == [g["reply_b"] for g in generations]  # B against B
    expected = length_controlled_win_rate(
        [PREFERENCE[v["verdict"]] for v in pairs],
        [v["tokens_a"] - v["tokens_b"] for v in pairs],
        groups=[v["prompt_id"] for v in pairs],
        anchors=AnchorRows(
            [PREFERENCE[v["verdict"]] for v in anchors],
            [v["tokens_a"] - v["tokens_b"] for v in anchors],
            [v["prompt_id"] for v in anchors],
            min_reaching=4,
            min_informative=8,  # tiny.yaml's
        ),
    )
    assert (metrics["lc_identifiable"], metrics["lc_anchor_pairs"]) == (float(expected.identifiable), 6)
    assert metrics.get("lc_win_rate") == (pytest.approx(expected.rate) if expected.identifiable else None)


def check_length_matched(out: Path, generations: list[dict], metrics: dict) -> None:
    mean_a, mean_b = (sum(g[f"tokens_{x}"] for g in generations) / 6 for x in "ab")
    assert metrics["length_ratio"] == pytest.approx(mean_a / mean_b)
    assert "judge/reward_length_spearman_b" in metrics or len({g["tokens_b"] for g in generations}) == 1
    matched = read_rows(out / "generations_matched.jsonl")
    matched_verdicts = read_rows(out / "verdicts_matched.jsonl")
    assert metrics["length_matched/pairs"] == len(matched) == len(matched_verdicts)
    for row in matched:
        assert abs(row["tokens_a"] - row["tokens_b"]) <= 0.2 * max(row["tokens_a"], row["tokens_b"])
        assert row["sample_a"] in (0, 1) and row["sample_b"] in (0, 1)


def test_eval_with_the_reward_model_judge_writes_the_report_and_chart(rlhf, eval_inputs, tmp_path: Path) -> None:
    out = tmp_path / "eval"
    status, stdout, stderr = eval_tiny(rlhf, eval_inputs, out, "--judge", "rm")
    assert status == 0, stderr
    assert "**Judge:** the in-sample reward model (IN-SAMPLE" in stdout and "In-sample judge" in stdout
    assert f"chart in {out / 'plots' / 'win_rate.png'}" in stdout
    assert {path.relative_to(out).as_posix() for path in out.rglob("*") if path.is_file()} == EVAL_FILES
    generations = read_rows(out / "generations.jsonl")
    verdicts = read_rows(out / "verdicts.jsonl")
    assert len(generations) == len(verdicts) == 6
    assert [g["prompt_id"] for g in generations] == [v["prompt_id"] for v in verdicts]
    assert all(g["tokens_a"] <= 6 and g["tokens_b"] <= 6 for g in generations)
    assert {v["verdict"] for v in verdicts} <= {"A", "B", "tie"}
    assert all(v["margin"] == pytest.approx(v["score_a"] - v["score_b"]) for v in verdicts)

    report = json.loads((out / "report.json").read_text())
    assert report["judge"]["kind"] == "rm" and report["judge"]["in_sample"] is True
    assert set(report["by_category"]) == {"harmless-base", "helpful-base"}
    assert report["generation"] == {
        "max_new_tokens": 6, "temperature": 0.8, "top_p": 0.9, "repetition_penalty": 1.1,
        "engine": "lean", "dtype": "float32", "sampler": "inverse_cdf", "kernel": "blocked",
    }  # fmt: skip
    metrics = json.loads((out / "metrics.json").read_text())
    wins = sum(v["verdict"] == "A" for v in verdicts)
    losses = sum(v["verdict"] == "B" for v in verdicts)
    assert metrics["win_minus_loss"] == pytest.approx((wins - losses) / 6)
    assert metrics["win_minus_loss_low"] <= metrics["win_minus_loss"] <= metrics["win_minus_loss_high"]
    assert metrics["perplexity_a"] > 1 and metrics["perplexity_b"] > 1
    assert metrics["alignment_tax_relative"] == pytest.approx(metrics["perplexity_a"] / metrics["perplexity_b"] - 1)
    check_length_controlled(out, generations, verdicts, metrics)
    check_length_matched(out, generations, metrics)
    assert stdout.index("Length-controlled win rate of A") < stdout.index("| all |")
    assert (out / "plots" / "win_rate.png").read_bytes()[:4] == b"\x89PNG"

    # A second judge that calls every pair a tie, compared with the first on the same (seeded) pairs.
    second = tmp_path / "eval-all-ties"
    agree = ["--rm-independent", "--agree-with", str(out / "verdicts.jsonl"), "-s", "evaluation.tie_margin=1e9"]
    status, stdout, stderr = eval_tiny(rlhf, eval_inputs, second, *agree)
    assert status == 0, stderr
    assert "In-sample judge" not in stdout
    first_judge = verdicts[0]["judge"]
    ties = sum(v["verdict"] == "tie" for v in verdicts)
    second_metrics = json.loads((second / "metrics.json").read_text())
    assert second_metrics["tie_rate"] == 1.0 and second_metrics["judge_in_sample"] == 0.0
    assert second_metrics[f"agreement/{first_judge}/pairs"] == 6
    assert second_metrics[f"agreement/{first_judge}/percent"] == pytest.approx(ties / 6)


@pytest.mark.slow
def test_eval_with_stderr_in_a_file_writes_no_bars_or_warnings_there(eval_inputs, tmp_path: Path) -> None:
    """A fresh `rlhf eval` (as a user runs it) loads its models: transformers' "Loading weights" bars and the
    libraries' warnings stay out of the redirected stderr."""
    stderr_file = tmp_path / "stderr.txt"
    command = [*RLHF_COMMAND, "eval"]
    command += ["--params", str(PARAMS)]
    command += ["--a", str(eval_inputs["ppo"]), "--b", str(eval_inputs["sft"]), "--rm-dir", str(eval_inputs["reward"])]
    command += ["--data-dir", str(eval_inputs["data"]), "-c", str(TINY), "-s", "evaluation.max_prompts=4"]
    command += ["-s", "evaluation.generation.max_new_tokens=4", "--out", str(tmp_path / "eval")]
    env = without_quiet_switches(dict(os.environ))
    with stderr_file.open("w") as stderr:
        result = subprocess.run(
            command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=stderr, text=True, timeout=600,
            env=env | {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)},
        )  # fmt: skip
    written = stderr_file.read_text()
    assert result.returncode == 0, written
    assert "eval: " in result.stdout and "pairs judged validly" in result.stdout
    assert library_output(written) == [] and "WARNING" not in written and "Warning" not in written, written


def test_llm_judge_without_an_endpoint_fails_naming_the_variables(
    rlhf, eval_inputs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in JUDGE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    out = tmp_path / "eval"
    status, _, stderr = rlhf(
        "eval",
        "--a",
        str(eval_inputs["ppo"]),
        "--b",
        str(eval_inputs["sft"]),
        "--judge",
        "llm",
        "--data-dir",
        str(eval_inputs["data"]),
        "-c",
        str(TINY),
        "--out",
        str(out),
    )
    assert status == 1
    message = stderr.strip()
    assert len(message.splitlines()) == 1 and message.startswith("rlhf: error:")
    assert "RLHF_JUDGE_API_KEY" in message and "RLHF_JUDGE_BASE_URL" in message and "--judge rm" in message
    assert not out.exists()  # checked before any work


def test_human_judge_points_to_the_flow(rlhf, eval_inputs) -> None:
    status, _, stderr = rlhf("eval", "--a", str(eval_inputs["ppo"]), "--b", str(eval_inputs["sft"]), "--judge", "human")
    assert status == 2
    assert "rlhf-human-eval" in stderr and "Prefect UI" in stderr


def test_an_unfinished_model_is_refused(rlhf, eval_inputs, tmp_path: Path) -> None:
    unfinished = tmp_path / "ppo"
    (unfinished / "model").mkdir(parents=True)
    (unfinished / "model" / "config.json").write_text("{}")
    status, _, stderr = eval_tiny(rlhf, eval_inputs, tmp_path / "eval", a=unfinished)
    assert status == 1
    assert "unfinished stage output" in stderr


def test_a_model_against_itself_is_refused_by_content_unless_allowed(rlhf, eval_inputs, tmp_path: Path) -> None:
    """The stage output and its model directory are one model: refused (every pair would tie), before any work;
    `--allow-same` evaluates them anyway, with a warning, and every pair is a tie."""
    out = tmp_path / "eval"
    status, _, stderr = eval_tiny(rlhf, eval_inputs, out, b=eval_inputs["ppo"] / "model")
    assert status == REFUSED_EXIT_CODE
    assert "model A and model B are the same model" in stderr and "--allow-same" in stderr
    assert not out.exists()

    status, _, stderr = eval_tiny(rlhf, eval_inputs, out, "--allow-same", b=eval_inputs["ppo"])
    assert status == 0, stderr
    (warning,) = [line for line in stderr.splitlines() if line.startswith("warning:")]
    assert "model A and model B are the same model" in warning and "evaluating anyway (--allow-same)" in warning
    assert json.loads((out / "metrics.json").read_text())["tie_rate"] == 1.0


@pytest.fixture(scope="module")
def registry(eval_inputs, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """An embedded MLflow registry as `rlhf run` leaves it: reward model, independent judge, and two policy
    versions (`champion`, then `challenger`) whose tags name the prepared data, their reward model and the judge.

    Returns (tracking URI, the judge's directory). Imported here: MLflow costs seconds to import.
    """
    from mlflow import MlflowClient

    from fixtures.stage_outputs import stage_output
    from tasks.registry.registered_models import (
        CHALLENGER_ALIAS,
        REWARD_VERSION_TAG,
        judge_version_tags,
        lineage_output_tags,
        register,
        training_data_tags,
    )
    from tasks.tracking.metrics_logger import get_or_create_experiment, local_artifact_location

    root = tmp_path_factory.mktemp("eval-registry")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    client = MlflowClient(uri)
    run_id = client.create_run(get_or_create_experiment(client, "eval", local_artifact_location(uri, root))).info.run_id
    judge_dir = root / "judge_reward"
    tokenizer = load_tiny_model()[1]
    RewardModel.from_causal_lm(build_tiny_model(tokenizer, seed=5), end_of_turn_id(tokenizer)).save_pretrained(
        judge_dir / "model", tokenizer
    )
    write_metrics(judge_dir, {"steps": 0.0})
    write_training_data(judge_dir, training_data_record(eval_inputs["data"], "ppo_pairs", "base"))
    reward = register(client, uri, run_id, "eval-reward", stage_output("reward", eval_inputs["reward"]), {}, None)
    judge_output = stage_output("judge-reward", judge_dir)
    judge = register(client, uri, run_id, "eval-reward-judge", judge_output, training_data_tags(judge_output), None)
    tags = {
        **lineage_output_tags({"prepare-data": stage_output("prepare-data", eval_inputs["data"], with_model=False)}),
        REWARD_VERSION_TAG: reward.version,
        **judge_version_tags(judge),
    }
    register(client, uri, run_id, "eval-policy", stage_output("ppo", eval_inputs["sft"]), tags, "champion")
    register(client, uri, run_id, "eval-policy", stage_output("ppo", eval_inputs["ppo"]), tags, CHALLENGER_ALIAS)
    register(client, uri, run_id, "eval-policy-unjudged", stage_output("ppo", eval_inputs["ppo"]), {}, CHALLENGER_ALIAS)
    return uri, judge_dir


@pytest.mark.slow
def test_eval_of_registered_models_takes_data_and_judge_from_the_lineage_and_says_so(
    rlhf, eval_inputs, registry, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After `rlhf run` there is no artifacts/: the README's `rlhf eval --a models:/...@challenger --b
    models:/...@champion` finds the eval data and the judge in the challenger's tags."""
    uri, judge_dir = registry
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("RLHF_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)  # nothing under artifacts/ here
    tiny = ["--params", str(PARAMS), "-c", str(TINY), "-s", "tracking.reward_model_name=eval-reward"]
    common = [*tiny, "-s", "evaluation.max_prompts=6", "-s", "evaluation.generation.max_new_tokens=4"]
    challenger, champion = "models:/eval-policy@challenger", "models:/eval-policy@champion"
    given = ["--rm-dir", str(judge_dir), "--data-dir", str(eval_inputs["data"])]

    status, stdout, stderr = rlhf("eval", "--a", challenger, "--b", champion, *common, "--out", str(tmp_path / "eval"))
    assert status == 0, stderr
    assert (
        f"eval data: {eval_inputs['data']} (the prepared data of eval-policy version 2, "
        "from models:/eval-policy@challenger)" in stdout.splitlines()
    )
    assert (
        "judge: independent judge reward model registered with the challenger (models:/eval-reward-judge/1) "
        "(from the lineage of eval-policy version 2)" in stdout.splitlines()
    )
    report = json.loads((tmp_path / "eval" / "report.json").read_text())
    assert report["judge"]["kind"] == "rm" and report["judge"]["in_sample"] is False
    assert "PPO-prompt split" in report["judge"]["description"]  # the registered judge's training_data tags
    verdicts = [json.loads(line) for line in (tmp_path / "eval" / "verdicts.jsonl").read_text().splitlines()]
    assert len(verdicts) == 6  # the eval split of the lineage's prepared data
    assert not (tmp_path / "artifacts").exists()  # the downloads are in the model cache, not the working tree
    assert len(list((tmp_path / "cache" / "registry").glob("eval-policy-v*"))) == 2

    # Given paths win over the lineage, and nothing is printed about it.
    sft = str(eval_inputs["sft"])
    status, stdout, stderr = rlhf(
        "eval", "--a", challenger, "--b", sft, *given, *common, "--out", str(tmp_path / "given")
    )
    assert status == 0, stderr
    assert "eval data:" not in stdout and "judge:" not in stdout.replace("**Judge:**", "")

    # The registry copy of a stage output is that model, by content: refused as the same model.
    ppo = str(eval_inputs["ppo"])
    status, _, stderr = rlhf("eval", "--a", challenger, "--b", ppo, *given, *common, "--out", str(tmp_path / "same"))
    assert status == REFUSED_EXIT_CODE and "model A and model B are the same model" in stderr

    # A version without a registered judge: one line naming the ways to give one, before any work.
    unjudged = "models:/eval-policy-unjudged@challenger"
    data = ["--data-dir", str(eval_inputs["data"])]
    status, _, stderr = rlhf(
        "eval", "--a", unjudged, "--b", champion, *common, *data, "--out", str(tmp_path / "unjudged")
    )
    assert status == 1 and len(stderr.strip().splitlines()) == 1
    assert "names no independent judge reward model" in stderr and "--rm-dir" in stderr
    assert "evaluation.judge_rm=in_sample" in stderr
    assert not (tmp_path / "unjudged").exists()
