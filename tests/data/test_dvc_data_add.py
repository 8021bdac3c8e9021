"""`rlhf data add` with real git, real DVC and an S3 remote served by `rclone serve s3` (tests/fixtures).

Each test works in a fresh git + DVC repository under tmp_path that carries the project's own DVC setup
(.dvc/config, .dvcignore), params.yaml and the tiny overlay; the S3 remote is configured with the commands
data/README.md documents. The fresh-clone test adds the pipeline (dvc.yaml and the code its first stage
depends on) and runs data/README.md's fresh-clone commands as written in a `git clone` of it. The data version is
checked against DVC's directory hash written out in plain
code: the md5 of the sorted JSON list of {"md5", "relpath"} of the files.
"""

import hashlib
import json
import os
import re
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner, Result

from fixtures.paths import ROOT
from fixtures.project_repos import PROJECT_FILES, copy_project_files, git
from fixtures.servers import S3Server
from rlhf_cli.data_commands import RawDataMismatchError, data_app
from rlhf_core.data.validation import DataValidationError
from rlhf_core.output_lock import OutputLockedError, output_lock
from tasks.data.dvc_data import DvcError, data_version, dvc_add, dvc_pull, dvc_push, run_dvc, workspace_matches

pytestmark = pytest.mark.slow

PIPELINE_FILES = ("dvc.yaml", "overlays.yaml")
PIPELINE_DIRS = ("rlhf_core", "configs")  # what dvc.yaml's prepare_data stage depends on
# data/README.md's fresh-clone commands, which the fresh-clone test runs exactly as they are written there.
PULL_RAW_DATA = "dvc pull data/raw.dvc"
REPRODUCE_PREPARED_DATA = "dvc repro prepare_data"
BUCKET = "dvc-data"
SPLIT_SALT = "rlhf-v1"  # params.yaml, data.split_salt
EVAL_FRACTION = 0.1  # params.yaml, data.eval_fraction


def make_project_repo(root: Path, with_pipeline: bool = False) -> Path:
    """A committed git repository holding the project's DVC setup, params.yaml and the tiny overlay (and, with
    `with_pipeline`, dvc.yaml and the code and configs its prepare_data stage depends on)."""
    root.mkdir()
    git(root, "init", "-q")
    copy_project_files(root, PROJECT_FILES + (PIPELINE_FILES if with_pipeline else ()))
    for name in PIPELINE_DIRS if with_pipeline else ():
        shutil.copytree(ROOT / name, root / name, ignore=shutil.ignore_patterns("__pycache__"), dirs_exist_ok=True)
    git(root, "add", "-A")
    git(root, "commit", "-q", "-m", "project")
    return root


def reference_is_eval(prompt: str) -> bool:
    prompt_id = hashlib.sha256(("user: " + " ".join(prompt.split()).casefold()).encode()).hexdigest()
    bucket = int.from_bytes(hashlib.sha256(f"{SPLIT_SALT}\n{prompt_id}".encode()).digest()[:8], "big") / 2**64
    return bucket < EVAL_FRACTION


def dvc_directory_md5(directory: Path) -> str:
    entries = sorted(
        (
            {"md5": hashlib.md5(path.read_bytes()).hexdigest(), "relpath": path.relative_to(directory).as_posix()}
            for path in directory.rglob("*")
            if path.is_file()
        ),
        key=lambda entry: entry["relpath"],
    )
    return hashlib.md5(json.dumps(entries, sort_keys=True).encode()).hexdigest() + ".dir"


def object_path(md5: str) -> str:
    """Where DVC 3 stores an object in a remote: files/md5/<first two hex digits>/<the rest>."""
    return f"files/md5/{md5[:2]}/{md5[2:]}"


def write_pairs(path: Path, rows: list[tuple[str, str]]) -> Path:
    """(prompt, chosen) rows in the prompt/chosen/rejected format, one JSON object a line."""
    lines = [json.dumps({"prompt": prompt, "chosen": chosen, "rejected": "No."}) for prompt, chosen in rows]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def rlhf_data(*args: str) -> Result:
    """Run `rlhf data ...` the way rlhf_cli/main.py registers it: app.add_typer(data_app, name="data")."""
    app = typer.Typer()
    app.add_typer(data_app, name="data")
    return CliRunner().invoke(app, ["data", *args])


PROMPTS = [f"How do I fix problem number {index}?" for index in range(60)]
EVAL_PROMPT = next(prompt for prompt in PROMPTS if reference_is_eval(prompt))
OTHER_PROMPT = next(prompt for prompt in PROMPTS if not reference_is_eval(prompt))


@pytest.fixture
def s3_repo(
    tmp_path: Path, s3_server: S3Server, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> tuple[Path, str]:
    """A project repository with an S3 remote `s3` (credentials from the AWS variables), as the cwd."""
    repo = make_project_repo(tmp_path / "repo")
    s3_server.create_bucket(BUCKET)
    prefix = request.node.name  # one folder of the bucket per test
    run_dvc(["remote", "add", "s3", f"s3://{BUCKET}/{prefix}"], repo)
    run_dvc(["remote", "modify", "s3", "endpointurl", s3_server.endpoint_url], repo)
    git(repo, "commit", "-q", "-am", "s3 remote")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_server.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_server.secret_key)
    monkeypatch.chdir(repo)
    return repo, prefix


@pytest.fixture
def added_repo(s3_repo: tuple[Path, str]) -> tuple[Path, str, str]:
    """s3_repo after `rlhf data add first.jsonl --remote s3` and a commit of data/raw.dvc."""
    repo, prefix = s3_repo
    first = write_pairs(repo.parent / "first.jsonl", [(prompt, "A helpful and careful answer.") for prompt in PROMPTS])
    result = rlhf_data("add", str(first), "--remote", "s3", "--config", "configs/tiny.yaml")
    assert result.exit_code == 0, result.output
    version = data_version(repo / "data/raw")
    assert f"data version {version}, pushed to DVC remote 's3'" in result.output
    git(repo, "add", "data/raw.dvc", "data/.gitignore")
    git(repo, "commit", "-q", "-m", "data: first")
    return repo, prefix, version


def test_add_pushes_to_s3_and_a_fresh_clone_pulls_the_same_data_after_refusing_to_add(
    added_repo: tuple[Path, str, str], s3_server: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    repo, prefix, version = added_repo
    raw = repo / "data/raw"
    assert [path.name for path in raw.iterdir()] == ["first.jsonl"]
    assert (raw / "first.jsonl").read_bytes() == (repo.parent / "first.jsonl").read_bytes()
    assert version == dvc_directory_md5(raw)
    file_md5 = hashlib.md5((raw / "first.jsonl").read_bytes()).hexdigest()
    listed = s3_server.client().list_objects_v2(Bucket=BUCKET, Prefix=f"{prefix}/")["Contents"]
    assert {f"{prefix}/{object_path(file_md5)}", f"{prefix}/{object_path(version)}"} <= {item["Key"] for item in listed}

    clone = tmp_path / "clone"
    git(tmp_path, "clone", "-q", str(repo), str(clone))
    assert not (clone / "data/raw").exists()
    # Adding before pulling would make a version without the existing rows: refused.
    monkeypatch.chdir(clone)
    new = write_pairs(tmp_path / "new.jsonl", [("A brand new question?", "An answer.")])
    refused = rlhf_data("add", str(new), "--remote", "s3", "--config", "configs/tiny.yaml")
    assert isinstance(refused.exception, RawDataMismatchError)
    assert "run `dvc pull data/raw.dvc` first" in str(refused.exception)
    assert not (clone / "data/raw").exists()

    # Credentials the other documented way: .dvc/config.local, not the environment.
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    run_dvc(["remote", "modify", "--local", "s3", "access_key_id", s3_server.access_key], clone)
    run_dvc(["remote", "modify", "--local", "s3", "secret_access_key", s3_server.secret_key], clone)
    dvc_pull(clone / "data/raw", remote="s3")

    assert (clone / "data/raw/first.jsonl").read_bytes() == (raw / "first.jsonl").read_bytes()
    assert dvc_directory_md5(clone / "data/raw") == version == data_version(clone / "data/raw")
    assert workspace_matches(clone / "data/raw")
    assert "config.local" not in git(clone, "ls-files", ".dvc")


def test_a_second_file_reports_rows_whose_prompt_is_in_the_evaluation_split(
    added_repo: tuple[Path, str, str], s3_server: S3Server
) -> None:
    repo, prefix, first_version = added_repo
    second = write_pairs(
        repo.parent / "second.jsonl",
        [
            ("A brand new question about gardening?", "Water it."),
            (EVAL_PROMPT, "A second, better answer."),
            (OTHER_PROMPT, "A second, better answer."),
        ],
    )
    result = rlhf_data("add", str(second), "--remote", "s3", "--config", "configs/tiny.yaml")
    assert result.exit_code == 0, result.output

    lines = result.output.splitlines()
    overlap_header = "evaluation split: 1 new row(s) have a prompt that is already an evaluation prompt"
    assert any(line.startswith(overlap_header) for line in lines), result.output
    overlap_rows = [line for line in lines if line.startswith("  line ")]
    assert len(overlap_rows) == 1 and overlap_rows[0].startswith("  line 2: prompt ")
    assert overlap_rows[0].endswith(repr(EVAL_PROMPT))
    version = data_version(repo / "data/raw")
    assert version != first_version and version == dvc_directory_md5(repo / "data/raw")
    assert f"data version {version}, pushed to DVC remote 's3'" in result.output
    s3_server.client().head_object(Bucket=BUCKET, Key=f"{prefix}/{object_path(version)}")  # raises if not pushed


def test_a_file_with_bad_rows_is_rejected_and_changes_nothing(
    added_repo: tuple[Path, str, str], s3_server: S3Server
) -> None:
    repo, prefix, _ = added_repo
    dvc_file_before = (repo / "data/raw.dvc").read_bytes()
    objects_before = s3_server.client().list_objects_v2(Bucket=BUCKET, Prefix=f"{prefix}/")["KeyCount"]
    bad = repo.parent / "bad.jsonl"
    bad.write_text(
        "{not json\n"
        + json.dumps({"prompt": "Q?", "chosen": "Same.", "rejected": "Same."})
        + "\n"
        + json.dumps({"question": "no preference fields"})
        + "\n"
        + json.dumps({"prompt": "Q2?", "chosen": "", "rejected": "No."})
        + "\n",
        encoding="utf-8",
    )
    result = rlhf_data("add", str(bad), "--remote", "s3", "--config", "configs/tiny.yaml")

    assert result.exit_code != 0
    assert isinstance(result.exception, DataValidationError)
    assert str(result.exception) == (
        f"data validation failed for {bad}: no valid preference pairs remain; kept 0/4 rows; "
        "drops by reason: empty_reply=1, identical_replies=1, malformed_json=1, missing_field=1; first dropped rows: "
        "empty_reply: bad.jsonl line 4 (chosen: the reply is empty); identical_replies: bad.jsonl line 2 (chosen "
        "and rejected replies are identical); malformed_json: bad.jsonl line 1 (not valid JSON: Expecting property "
        "name enclosed in double quotes: line 1 column 2 (char 1)); missing_field: bad.jsonl line 3 (row has none "
        "of the fields prompt/chosen/rejected (keys: ['question']))"
    )
    assert [path.name for path in (repo / "data/raw").iterdir()] == ["first.jsonl"]
    assert (repo / "data/raw.dvc").read_bytes() == dvc_file_before
    assert s3_server.client().list_objects_v2(Bucket=BUCKET, Prefix=f"{prefix}/")["KeyCount"] == objects_before


def test_the_default_remote_is_a_directory_in_the_user_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    repo = make_project_repo(tmp_path / "repo")
    raw = repo / "data/raw"
    raw.mkdir(parents=True)
    write_pairs(raw / "pairs.jsonl", [("Q?", "An answer.")])
    version = dvc_add(raw)
    assert workspace_matches(raw)

    home = tmp_path / "home"  # `~` in .dvc/config: DVC expands it for the dvc process
    monkeypatch.setenv("HOME", str(home))
    dvc_push(raw)  # no remote named: core.remote, "local"

    remote = home / ".cache/rlhf-pipeline/dvc-remote"
    file_md5 = hashlib.md5((raw / "pairs.jsonl").read_bytes()).hexdigest()
    assert (remote / object_path(file_md5)).is_file()
    assert (remote / object_path(version)).is_file()

    (raw / "pairs.jsonl").write_text("edited\n")
    assert not workspace_matches(raw)


def test_a_second_add_while_one_is_adding_fails_at_once_and_writes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    repo = make_project_repo(tmp_path / "repo")
    monkeypatch.chdir(repo)
    new = write_pairs(tmp_path / "new.jsonl", [("A brand new question?", "An answer.")])

    with output_lock(repo / "data/raw", "data add"):  # another `rlhf data add` in the middle of its merge
        result = rlhf_data("add", str(new), "--config", "configs/tiny.yaml")

    assert isinstance(result.exception, OutputLockedError)
    assert f"pid {os.getpid()}" in str(result.exception) and "data add" in str(result.exception)
    assert not (repo / "data/raw").exists() and not (repo / "data/raw.dvc").exists()


def test_a_failed_dvc_add_takes_the_copied_file_out_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    project = tmp_path / "not-a-dvc-repo"  # no git, no .dvc: `dvc add` fails
    project.mkdir()
    copy_project_files(project, ("params.yaml", "configs/tiny.yaml"))
    monkeypatch.chdir(project)
    new = write_pairs(tmp_path / "new.jsonl", [("A brand new question?", "An answer.")])

    result = rlhf_data("add", str(new), "--config", "configs/tiny.yaml")

    assert isinstance(result.exception, DvcError)
    assert "`dvc add raw` failed" in str(result.exception)
    assert list((project / "data/raw").iterdir()) == []
    assert not (project / "data/raw.dvc").exists()


def test_a_failed_push_keeps_the_new_local_version_and_says_how_to_retry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    repo = make_project_repo(tmp_path / "repo")
    monkeypatch.chdir(repo)
    new = write_pairs(tmp_path / "new.jsonl", [("A brand new question?", "An answer.")])

    result = rlhf_data("add", str(new), "--remote", "nowhere", "--config", "configs/tiny.yaml")

    assert isinstance(result.exception, DvcError)
    version = data_version(repo / "data/raw")
    assert str(result.exception).startswith(
        f"data version {version} is in the local DVC cache but was not pushed; "
        "retry with `dvc push -r nowhere data/raw.dvc`. `dvc push --remote nowhere raw.dvc` failed"
    )
    assert version == dvc_directory_md5(repo / "data/raw")
    assert workspace_matches(repo / "data/raw")


def documented_commands(path: Path) -> list[str]:
    """The command lines of the ```bash blocks of a markdown file, without their trailing comments."""
    blocks = re.findall(r"```bash\n(.*?)```", path.read_text(encoding="utf-8"), flags=re.DOTALL)
    return [line.split("  #")[0].strip() for block in blocks for line in block.splitlines() if line.strip()]


def run_as_written(command: str, cwd: Path) -> subprocess.CompletedProcess:
    """A documented `dvc ...` command line, run by the DVC installed with this interpreter."""
    args = command.split()
    assert args[0] == "dvc", command
    return subprocess.run(["python3", "-m", "dvc", *args[1:]], cwd=cwd, capture_output=True, text=True, check=False)


def test_data_readme_documents_the_fresh_clone_commands() -> None:
    documented = documented_commands(ROOT / "data/README.md")
    assert {"rlhf data status", "dvc pull", "dvc status", PULL_RAW_DATA, REPRODUCE_PREPARED_DATA} <= set(documented)


def test_a_fresh_clone_gets_the_data_with_the_documented_commands(
    tmp_path: Path, s3_server: S3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    repo = make_project_repo(tmp_path / "repo", with_pipeline=True)
    s3_server.create_bucket(BUCKET)
    run_dvc(["remote", "add", "-d", "s3", f"s3://{BUCKET}/fresh-clone"], repo)  # data/README.md, "Remotes"
    run_dvc(["remote", "modify", "s3", "endpointurl", s3_server.endpoint_url], repo)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_server.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_server.secret_key)
    # `dvc repro` runs the stage's `rlhf` command: the console script installed beside this interpreter.
    monkeypatch.setenv("PATH", os.pathsep.join([sysconfig.get_path("scripts"), os.environ["PATH"]]))
    raw = repo / "data/raw"
    versions = []
    for name, prompts in (("first.jsonl", PROMPTS[:40]), ("second.jsonl", PROMPTS[40:])):
        raw.mkdir(parents=True, exist_ok=True)
        write_pairs(raw / name, [(prompt, "A helpful and careful answer.") for prompt in prompts])
        versions.append(dvc_add(raw))
        dvc_push(raw)
        git(repo, "add", "-A")
        git(repo, "commit", "-q", "-m", f"data: {name}")
    first_commit = git(repo, "rev-parse", "HEAD~1").strip()

    clone = tmp_path / "clone"
    git(tmp_path, "clone", "-q", str(repo), str(clone))
    for command in ("dvc pull", PULL_RAW_DATA, REPRODUCE_PREPARED_DATA):  # no stage output is DVC-cached
        completed = run_as_written(command, clone)
        assert completed.returncode == 0, f"{command}: {completed.stderr}"
    assert data_version(clone / "data/raw") == versions[1] == dvc_directory_md5(clone / "data/raw")
    report = json.loads((clone / "artifacts/data/data_report.json").read_text())
    assert report["rows_read"] == len(PROMPTS)
    assert (clone / "artifacts/data/sft.parquet").is_file() and (clone / "dvc.lock").is_file()

    # A committed dvc.lock pins the prepared data: another clone reproduces the same bytes from the raw data.
    git(clone, "add", "dvc.lock")
    git(clone, "commit", "-q", "-m", "prepared data")
    second_clone = tmp_path / "second-clone"
    git(tmp_path, "clone", "-q", str(clone), str(second_clone))
    for command in ("dvc pull", REPRODUCE_PREPARED_DATA):
        completed = run_as_written(command, second_clone)
        assert completed.returncode == 0, f"{command}: {completed.stderr}"
    prepared = second_clone / "artifacts/data/sft.parquet"
    assert prepared.read_bytes() == (clone / "artifacts/data/sft.parquet").read_bytes()

    # `git checkout <commit> && dvc pull data/raw.dvc` brings back the data of that commit.
    git(clone, "checkout", "-q", first_commit)
    assert run_as_written(PULL_RAW_DATA, clone).returncode == 0
    assert data_version(clone / "data/raw") == versions[0] == dvc_directory_md5(clone / "data/raw")
    assert workspace_matches(clone / "data/raw")
