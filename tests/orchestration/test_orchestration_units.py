"""Unit tests of the orchestration building blocks that need no server: hashing, cache keys, retry
condition, data versions, stage selection, lineage and the Prefect UI form of the pipeline settings."""

import hashlib
import json
from pathlib import Path

import pytest
from prefect.states import Completed, Failed

from fixtures.paths import PARAMS, ROOT, TINY
from flows.pipeline import PipelineSettings, Stage, rlhf_pipeline, stages_to_run
from rlhf_core.config import ConfigError, load_config
from rlhf_core.data.readers import DataSourceError
from rlhf_core.data.validation import DataValidationError
from rlhf_core.distributed.launcher import RankFailedError
from rlhf_core.output_lock import OutputLockedError
from rlhf_core.stage_outputs import StageOutput, directory_sha256, output_sha256
from rlhf_core.stages.training_run import ResumeMismatchError
from tasks.data.data_source import resolve_data_source
from tasks.execution.caching import code_fingerprint, source_fingerprint, stage_cache_key
from tasks.execution.retries import is_retryable
from tasks.stages.artifacts import read_samples, summary_markdown
from tasks.stages.stage_runs import STAGE_SECTIONS
from tasks.tracking.lineage import config_sha256, dependency_set_sha256, git_state


@pytest.fixture(scope="module")
def tiny_config():
    return load_config(PARAMS, [TINY])


def write_files(root: Path, files: dict[str, bytes]) -> Path:
    for relative, content in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)
    return root


def reference_directory_hash(root: Path, relatives: list[str]) -> str:
    """The documented scheme written out plainly: sorted (relative path, sha256 of bytes) pairs."""
    digest = hashlib.sha256()
    for relative in sorted(relatives):
        digest.update(relative.encode() + b"\0")
        digest.update(hashlib.sha256((root / relative).read_bytes()).hexdigest().encode() + b"\n")
    return digest.hexdigest()


def test_directory_hash_covers_content_and_paths_but_not_records_or_checkpoints(tmp_path: Path) -> None:
    root = write_files(
        tmp_path / "out",
        {
            "a.parquet": b"alpha",
            "sub/b.parquet": b"beta",
            "metrics.json": b'{"wall_seconds": 1.5}',
            "history.jsonl": b'{"step": 1}\n',
            "checkpoints/step-2/state.pt": b"resume me",
            "plots/x.png": b"png",
        },
    )
    expected = reference_directory_hash(root, ["a.parquet", "sub/b.parquet"])
    assert directory_sha256(root) == expected

    (root / "metrics.json").write_text('{"wall_seconds": 9.0}')
    (root / "checkpoints" / "step-4").mkdir()
    assert directory_sha256(root) == expected  # records and checkpoints are not content

    (root / "sub" / "b.parquet").rename(root / "b.parquet")
    assert directory_sha256(root) != expected  # same bytes, other path
    (root / "b.parquet").write_bytes(b"beta!")
    assert directory_sha256(root) == reference_directory_hash(root, ["a.parquet", "b.parquet"])


def test_stage_output_is_intact_until_deleted_or_changed(tmp_path: Path) -> None:
    out_dir = write_files(tmp_path / "sft", {"model/model.safetensors": b"weights", "metrics.json": b"{}"})
    output = StageOutput(
        stage="sft", out_dir=out_dir, sha256=output_sha256(out_dir, out_dir / "model"), model_dir=out_dir / "model"
    )
    assert output.sha256 == directory_sha256(out_dir / "model")
    assert output.is_intact()

    (out_dir / "model" / "model.safetensors").write_bytes(b"other weights")
    assert not output.is_intact()
    (out_dir / "model" / "model.safetensors").write_bytes(b"weights")
    assert output.is_intact()
    (out_dir / "metrics.json").unlink()  # incomplete: the marker written last is gone
    assert not output.is_intact()


def test_cache_key_depends_on_own_sections_and_inputs_only(tiny_config) -> None:
    inputs = {"data": "d" * 64}
    sft_key = stage_cache_key("sft", tiny_config, STAGE_SECTIONS["sft"], inputs)
    assert stage_cache_key("sft", tiny_config, STAGE_SECTIONS["sft"], dict(inputs)) == sft_key

    other_ppo = tiny_config.model_copy(update={"ppo": tiny_config.ppo.model_copy(update={"kl_coef": 0.5})})
    assert stage_cache_key("sft", other_ppo, STAGE_SECTIONS["sft"], inputs) == sft_key
    assert stage_cache_key("ppo", other_ppo, STAGE_SECTIONS["ppo"], inputs) != stage_cache_key(
        "ppo", tiny_config, STAGE_SECTIONS["ppo"], inputs
    )
    other_sft = tiny_config.model_copy(update={"sft": tiny_config.sft.model_copy(update={"lr": 0.5})})
    assert stage_cache_key("sft", other_sft, STAGE_SECTIONS["sft"], inputs) != sft_key
    assert stage_cache_key("sft", tiny_config, STAGE_SECTIONS["sft"], {"data": "e" * 64}) != sft_key
    reseeded = tiny_config.model_copy(update={"seed": tiny_config.seed + 1})
    assert stage_cache_key("sft", reseeded, STAGE_SECTIONS["sft"], inputs) != sft_key


def test_cache_key_changes_with_the_code(tiny_config, monkeypatch: pytest.MonkeyPatch) -> None:
    inputs = {"data": "d" * 64}
    key = stage_cache_key("sft", tiny_config, STAGE_SECTIONS["sft"], inputs)
    assert code_fingerprint().endswith("+" + source_fingerprint(ROOT / "rlhf_core"))  # the library's sources
    monkeypatch.setattr("tasks.execution.caching.code_fingerprint", lambda: "0.2.0+" + "f" * 64)
    assert stage_cache_key("sft", tiny_config, STAGE_SECTIONS["sft"], inputs) != key


def test_source_fingerprint_follows_python_and_c_sources_only(tmp_path: Path) -> None:
    (tmp_path / "stages").mkdir()
    (tmp_path / "stages" / "sft.py").write_text("LR = 1e-5\n")
    (tmp_path / "losses.py").write_text("def loss(): ...\n")
    (tmp_path / "kernel.c").write_text("void f(void) {}\n")
    first = source_fingerprint(tmp_path)
    (tmp_path / "kernel.c").write_text("void f(void) { }\n")
    assert source_fingerprint(tmp_path) != first
    (tmp_path / "kernel.c").write_text("void f(void) {}\n")
    (tmp_path / "README.md").write_text("docs do not count")
    (tmp_path / "stages" / "sft.pyc").write_bytes(b"compiled files do not count")
    assert source_fingerprint(tmp_path) == first
    (tmp_path / "stages" / "sft.py").write_text("LR = 2e-5\n")
    assert source_fingerprint(tmp_path) != first
    (tmp_path / "stages" / "sft.py").write_text("LR = 1e-5\n")
    assert source_fingerprint(tmp_path) == first
    (tmp_path / "stages" / "sft.py").rename(tmp_path / "stages" / "reward.py")  # same bytes, another module
    assert source_fingerprint(tmp_path) != first


@pytest.mark.parametrize(
    ("error", "retried"),
    [
        (ConfigError("bad key"), False),
        (DataValidationError("all rows dropped"), False),
        (DataSourceError("missing"), False),
        (ValueError("no held-out prompts"), False),
        (ResumeMismatchError("checkpoints of other settings"), False),
        (OutputLockedError("another process writes it"), False),
        (RankFailedError("rank 0 failed", 0, "OutputLockedError", []), False),
        (RuntimeError("worker lost"), True),
        (MemoryError(), True),
        (OSError("disk hiccup"), True),
        (RankFailedError("rank 1 failed", 1, "DataValidationError", []), False),
        (RankFailedError("rank 0 failed", 0, "RuntimeError", []), True),
        (RankFailedError("launcher died", None, None, []), True),
    ],
)
def test_retry_condition_retries_only_what_may_be_transient(error: Exception, retried: bool) -> None:
    assert is_retryable(None, None, Failed(data=error)) is retried


def test_retry_condition_accepts_a_non_exception_state() -> None:
    assert is_retryable(None, None, Completed(data=1)) is True


def test_data_source_versions(tmp_path: Path, tiny_config) -> None:
    data_file = tmp_path / "pairs.jsonl"
    data_file.write_bytes(b'{"prompt": "p", "chosen": "a", "rejected": "b"}\n')
    local = resolve_data_source(str(data_file), tiny_config)
    assert (local.kind, local.uri, local.version) == (
        "file",
        str(data_file.resolve()),
        hashlib.sha256(data_file.read_bytes()).hexdigest(),
    )

    hub = resolve_data_source("Anthropic/hh-rlhf", tiny_config)
    assert hub.kind == "hub" and hub.uri == "Anthropic/hh-rlhf"
    other_split = tiny_config.model_copy(update={"data": tiny_config.data.model_copy(update={"hub_split": "test"})})
    assert resolve_data_source("Anthropic/hh-rlhf", other_split).version != hub.version

    with pytest.raises(DataSourceError, match="missing.jsonl does not exist"):
        resolve_data_source(str(tmp_path / "missing.jsonl"), tiny_config)


@pytest.mark.parametrize(
    ("wanted", "expected"),
    [
        ([Stage.PREPARE_DATA], {Stage.PREPARE_DATA}),
        ([Stage.REWARD], {Stage.PREPARE_DATA, Stage.SFT, Stage.REWARD}),
        ([Stage.REGISTER], set(Stage)),
        ([Stage.SFT, Stage.PPO], {Stage.PREPARE_DATA, Stage.SFT, Stage.REWARD, Stage.PPO}),
    ],
)
def test_selected_stages_bring_their_dependencies(wanted: list[Stage], expected: set[Stage]) -> None:
    assert stages_to_run(wanted) == expected


def test_pipeline_settings_form_lists_every_field_and_stage() -> None:
    schema = rlhf_pipeline.parameters.model_dump()
    settings_schema = schema["definitions"]["PipelineSettings"]
    assert set(settings_schema["properties"]) == set(PipelineSettings.model_fields)
    assert schema["definitions"]["Stage"]["enum"] == [stage.value for stage in Stage]
    assert PipelineSettings().stages == list(Stage)
    with pytest.raises(ValueError, match="extra"):
        PipelineSettings.model_validate({"stage": ["sft"]})  # a typo is an error, not ignored


@pytest.mark.slow
def test_lineage_hashes(tmp_path: Path, tiny_config) -> None:
    assert git_state(tmp_path) == ("unknown", None)
    commit, dirty = git_state(ROOT)
    assert len(commit) == 40 and isinstance(dirty, bool)
    assert dependency_set_sha256() == dependency_set_sha256()
    changed = tiny_config.model_copy(update={"seed": 7})
    assert config_sha256(changed) != config_sha256(tiny_config)
    assert (
        config_sha256(tiny_config)
        == hashlib.sha256(json.dumps(tiny_config.model_dump(mode="json"), sort_keys=True).encode()).hexdigest()
    )


def test_read_samples_keeps_the_newest_rows_as_short_strings(tmp_path: Path) -> None:
    path = tmp_path / "samples.jsonl"
    rows = [{"step": step, "response": "x" * 1000, "score": 0.5} for step in range(5)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    table = read_samples(path, max_rows=2)
    assert [row["step"] for row in table] == ["3", "4"]
    assert len(table[0]["response"]) == 500 and table[0]["response"].endswith("...")
    assert table[0]["score"] == "0.5"


def test_summary_markdown_names_output_hash_run_and_metrics(tmp_path: Path) -> None:
    output = StageOutput(stage="ppo", out_dir=tmp_path, sha256="ab" * 32, metrics={"kl": 0.0123456, "reward": 1.0})
    text = summary_markdown(output, "http://mlflow/#/runs/1")
    assert f"`{tmp_path}`" in text and "`" + "ab" * 8 + "`" in text and "http://mlflow/#/runs/1" in text
    assert "| kl | 0.0123456 |" in text and "| reward | 1 |" in text
    assert "Skill beyond length" not in text  # not a reward model


def test_summary_markdown_shows_a_reward_models_skill_beyond_length(tmp_path: Path) -> None:
    metrics = {
        "val/accuracy": 0.65,
        "val/accuracy_low": 0.607,
        "val/accuracy_high": 0.69,
        "val/length_rule_accuracy": 0.572,
        "val/length_rule_prefers_shorter": 1.0,
        "val/balanced_accuracy": 0.6236,
        "val/accuracy_chosen_shorter": 0.789,
        "val/pairs_chosen_shorter": 289.0,
        "val/accuracy_chosen_longer": 0.458,
        "val/pairs_chosen_longer": 216.0,
        "val/length_matched_pairs": 0.0,
        "val/auc_gain_over_length": 0.051,
        "val/auc_gain_over_length_low": 0.02,
        "val/auc_gain_over_length_high": 0.08,
        "val/reward_length_spearman": -0.55,
    }
    output = StageOutput(stage="reward", out_dir=tmp_path, sha256="ab" * 32, metrics=metrics)
    text = summary_markdown(output, "run-1")
    assert "| accuracy | 0.650 (0.607-0.690) |" in text
    assert "| length rule (shorter reply wins) | 0.572 |" in text
    assert "| balanced accuracy | 0.624 (chosen shorter 0.789 on 289, chosen longer 0.458 on 216) |" in text
    assert "| length-matched accuracy | n/a (n/a-n/a) on 0 pairs |" in text  # no length-matched pair
    assert "| AUC gain over length | +0.051 (+0.020 to +0.080) |" in text
    assert "| reward-length Spearman | -0.55 |" in text
    assert "| val/balanced_accuracy | 0.6236 |" in text  # and every figure in the full table


@pytest.mark.slow
def test_dvc_tracked_data_is_versioned_by_its_dvc_md5(tmp_path: Path, tiny_config) -> None:
    import subprocess
    import sys

    from tasks.data.dvc_data import data_version, dvc_add

    subprocess.run([sys.executable, "-m", "dvc", "init", "--no-scm", "-q"], cwd=tmp_path, check=True)
    raw = write_files(tmp_path / "data" / "raw", {"pairs.jsonl": b'{"prompt": "p", "chosen": "a", "rejected": "b"}\n'})
    md5 = dvc_add(raw)

    tracked = resolve_data_source(str(raw), tiny_config)
    assert (tracked.kind, tracked.version) == ("dvc", md5) and md5 == data_version(raw)

    (raw / "pairs.jsonl").write_bytes(b'{"prompt": "q", "chosen": "a", "rejected": "b"}\n')
    edited = resolve_data_source(str(raw), tiny_config)  # no longer what the .dvc file records
    assert (edited.kind, edited.version) == ("file", directory_sha256(raw))
