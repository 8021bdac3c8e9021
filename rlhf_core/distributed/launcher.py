"""Start a stage on several processes with the `deepspeed` launcher, stream their logs, report failures.

Why the `deepspeed` launcher (and not `accelerate launch`): the training code already drives DeepSpeed
engines directly (rlhf_core/training/deepspeed_update.py), the launcher ships with the deepspeed package the project
depends on
(nothing else to install or configure), and one command covers a single node (`--num_gpus`) and
several (`--hostfile`, over ssh/pdsh or MPI) with the same flags. `accelerate launch` would add a
second configuration layer (its own YAML) that would have to agree with params.yaml and the rendered
DeepSpeed config. On a machine without GPUs DeepSpeed falls back to its CPU accelerator and the gloo
backend: `--num_gpus N` then simply starts N CPU processes (the tests do this).

What `run_launch` does:
* runs `python -m deepspeed.launcher.runner --num_gpus N ... --no_local_rank --enable_each_rank_log DIR
  --module <module> <args>` as a subprocess (the same interpreter, so the same environment);
* follows each rank's log file in DIR (and the launcher's own output) and hands every line, with the
  rank it came from, to `on_line` as it appears (the Prefect task forwards them to its run logger);
* on a non-zero exit raises `RankFailedError` naming the rank that failed first, with its exception
  (from the rank's error record, `rank_errors.py`) and the last lines of its log.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from rlhf_core.config import Config, DistributedConfig
from rlhf_core.distributed.rank_errors import ERROR_DIR_ENV, read_rank_errors

WORKER_MODULE = "rlhf_core.stages.worker"
POLL_SECONDS = 0.2
TAIL_LINES = 40
RANK_TAIL_LINES = 15  # per rank, when no rank recorded an error
LineCallback = Callable[[int | None, str], None]  # (rank, or None for the launcher itself; line)
StopCheck = Callable[[], bool]  # polled while a launch runs: true stops it


class RankFailedError(RuntimeError):
    """A launched run failed. `rank` is the rank that failed first (None when no rank recorded an error)."""

    def __init__(self, message: str, rank: int | None, error_type: str | None, tail: list[str]) -> None:
        super().__init__(message)
        self.rank = rank
        self.error_type = error_type
        self.tail = tail


@dataclass(frozen=True)
class Launch:
    """One launch: which module the ranks run with which arguments, how many, and where logs go."""

    module: str
    args: list[str]
    distributed: DistributedConfig
    log_dir: Path
    env: dict[str, str] = field(default_factory=dict)

    @property
    def rank_log_dir(self) -> Path:
        return self.log_dir / "ranks"

    @property
    def error_dir(self) -> Path:
        return self.log_dir / "errors"

    @property
    def launcher_log(self) -> Path:
        return self.log_dir / "launcher.log"


class LaunchStoppedError(RuntimeError):
    """A launch stopped on request (`run_launch`'s `stop`): its processes were terminated."""


def launcher_command(spec: Launch) -> list[str]:
    """The `deepspeed` launcher command line (run with this interpreter: `-m deepspeed.launcher.runner`);
    a world of one process needs no launcher (nor its 10-20 s import of deepspeed): the module runs directly,
    its output in the launcher's log."""
    distributed = spec.distributed
    if distributed.world_size == 1:
        return [sys.executable, "-u", "-m", spec.module, *spec.args]
    command = [sys.executable, "-u", "-m", "deepspeed.launcher.runner", "--num_gpus", str(distributed.num_processes)]
    if distributed.num_nodes > 1:
        command += ["--num_nodes", str(distributed.num_nodes), "--hostfile", str(distributed.hostfile)]
    if distributed.master_addr is not None:
        command += ["--master_addr", distributed.master_addr]
    command += ["--master_port", str(distributed.master_port)]
    command += ["--no_local_rank", "--enable_each_rank_log", str(spec.rank_log_dir), "--module", spec.module]
    return command + list(spec.args)


class _LogFollower:
    """Reads the complete lines appended to one file since the last call."""

    def __init__(self, path: Path, rank: int | None) -> None:
        self.path = path
        self.rank = rank
        self.offset = 0
        self.partial = ""
        self.lines: list[str] = []

    def poll(self, on_line: LineCallback, final: bool = False) -> None:
        """Hand on the new complete lines; with `final`, an unterminated last line too."""
        if not self.path.is_file():
            return
        with self.path.open("r", encoding="utf-8", errors="replace") as handle:
            handle.seek(self.offset)
            text = handle.read()
            self.offset = handle.tell()
        lines = (self.partial + text).split("\n")
        self.partial = lines.pop()  # "" when the text ended with a newline
        if final and self.partial:
            lines.append(self.partial)
            self.partial = ""
        for line in lines:
            self.lines.append(line)
            on_line(self.rank, line)


def _rank_of_log(path: Path) -> int:
    """The rank of a per-rank log file, named `<timestamp>_rank<r>.log` by the launcher."""
    return int(path.stem.rsplit("_rank", 1)[1])


def _follow(
    process: subprocess.Popen[bytes], spec: Launch, on_line: LineCallback, stop: StopCheck | None = None
) -> dict[int | None, _LogFollower]:
    """Stream every log line until the launcher exits; returns the followers (each holds its lines).
    Raises `LaunchStoppedError` as soon as `stop()` is true."""
    followers: dict[int | None, _LogFollower] = {None: _LogFollower(spec.launcher_log, None)}
    while True:
        if stop is not None and stop():
            raise LaunchStoppedError(f"launch of {spec.module} {' '.join(spec.args[:1])} stopped on request")
        finished = process.poll() is not None
        for path in spec.rank_log_dir.glob("*_rank*.log"):
            rank = _rank_of_log(path)
            followers.setdefault(rank, _LogFollower(path, rank))
        for follower in followers.values():
            follower.poll(on_line, final=finished)
        if finished:
            return followers
        time.sleep(POLL_SECONDS)


def _failure(spec: Launch, returncode: int, followers: dict[int | None, _LogFollower]) -> RankFailedError:
    """The error to raise for a failed launch: the first recorded rank error, with its log's tail."""
    world = spec.distributed.world_size
    errors = read_rank_errors(spec.error_dir)
    if errors:
        first = errors[0]
        follower = followers.get(first.rank, followers[None])  # a world of one logs to the launcher's log
        tail = follower.lines[-TAIL_LINES:]
        message = (
            f"rank {first.rank} of {world} failed: {first.error_type}: {first.message}\n"
            f"--- last lines of rank {first.rank} (all logs: {spec.log_dir}) ---\n" + "\n".join(tail)
        )
        return RankFailedError(message, first.rank, first.error_type, tail)
    tail = followers[None].lines[-TAIL_LINES:]
    message = (
        f"the {world}-process launch exited with status {returncode} and no rank recorded an error "
        "(killed by a signal or out of memory?)\n"
        f"--- last lines of the launcher (all logs: {spec.log_dir}) ---\n" + "\n".join(tail)
    )
    return RankFailedError(message + _rank_tails(followers), None, None, tail)


def _rank_tails(followers: dict[int | None, _LogFollower]) -> str:
    """The last lines of every rank's own log: where a rank that died without a Python error (a native
    abort, "terminate called ...", a fatal Python error) said why; the launcher's log only has its status."""
    ranks = sorted(rank for rank in followers if rank is not None)
    return "".join(
        f"\n--- last lines of rank {rank} ---\n" + "\n".join(followers[rank].lines[-RANK_TAIL_LINES:]) for rank in ranks
    )


def run_launch(spec: Launch, on_line: LineCallback, stop: StopCheck | None = None) -> None:
    """Run `spec` to completion, streaming log lines to `on_line`; raise `RankFailedError` on failure.

    If this process is interrupted (or `on_line` raises, or `stop()` turns true: another stage of the
    same pipeline run failed), the launcher is terminated, which makes it kill every rank.
    """
    spec.rank_log_dir.mkdir(parents=True, exist_ok=True)
    spec.error_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **spec.env, ERROR_DIR_ENV: str(spec.error_dir), "PYTHONUNBUFFERED": "1"}
    with spec.launcher_log.open("wb") as launcher_output:
        process = subprocess.Popen(launcher_command(spec), stdout=launcher_output, stderr=subprocess.STDOUT, env=env)
        try:
            followers = _follow(process, spec, on_line, stop)
        except BaseException:
            process.terminate()
            process.wait()
            raise
    if process.returncode != 0:
        raise _failure(spec, process.returncode, followers)


def new_log_dir(root: Path) -> Path:
    """A fresh directory for one launch's logs under `root` (earlier launches' logs are kept)."""
    directory = Path(root) / datetime.now().strftime("launch-%Y%m%d-%H%M%S-%f")
    directory.mkdir(parents=True, exist_ok=False)
    return directory


def launch_stage(
    stage: str,
    config: Config,
    out_dir: Path,
    on_line: LineCallback,
    *,
    data_dir: Path,
    sft_dir: Path | None = None,
    rm_dir: Path | None = None,
    env: dict[str, str] | None = None,
    stop: StopCheck | None = None,
) -> None:
    """Run a training stage (`sft`, `reward`, `ppo`, `judge-reward`) on `config.distributed`'s processes into
    `out_dir`, with `env` added to their environment (their thread count, say); `stop` as in `run_launch`.

    The resolved config is written next to the logs, under `out_dir/logs/launch-*/`.
    """
    out_dir = Path(out_dir)
    log_dir = new_log_dir(out_dir / "logs")
    config_file = log_dir / "config.json"
    config_file.write_text(config.model_dump_json(indent=2), encoding="utf-8")
    args = [stage, "--config", str(config_file), "--data-dir", str(data_dir), "--out", str(out_dir)]
    if sft_dir is not None:
        args += ["--sft-dir", str(sft_dir)]
    if rm_dir is not None:
        args += ["--rm-dir", str(rm_dir)]
    spec = Launch(module=WORKER_MODULE, args=args, distributed=config.distributed, log_dir=log_dir, env=env or {})
    run_launch(spec, on_line, stop)
