"""The team stack of infra/compose.yaml on one machine without containers (HPC clusters, no Docker).

    python infra/native/stack.py up [--env-file infra/.env] [--state-dir .stack] [--project-dir .]
                                    [--port SERVICE=PORT ...]
    python infra/native/stack.py status [--state-dir .stack]
    python infra/native/stack.py restart SERVICE [--state-dir .stack]
    python infra/native/stack.py kill SERVICE [--state-dir .stack]
    python infra/native/stack.py down [--state-dir .stack]

`up` starts every service of compose.yaml as a native process, in compose's dependency order, each once
the ones before it are healthy: the credentials check, the two PostgreSQL servers, an S3 server standing
in for MinIO (`rclone serve s3`, its buckets), the Prefect server, the MLflow server, the CPU and GPU
workers; then it registers the deployments of prefect.yaml (`prefect deploy --all`) and returns, leaving
the services running. Commands and settings come from compose.yaml itself (stack_compose.py). The state
folder holds the databases, the S3 data, each service's log and `stack.json` (process groups, ports,
addresses), which `status`, `restart` and `down` read; `restart` stops one service and starts it again on
the same port and data, `kill` ends one as a crash would (SIGKILL, with all it started); `down` stops every process and
keeps the data, as
`docker compose down` does.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

from stack_compose import INFRA, Placement, container_port, load_services, read_env_file, start_order
from stack_processes import StackError, family_groups, group_alive, kill_groups, stop_group
from stack_services import ServiceStarter

CHECKOUT = INFRA.parent
STATE_FILE = "stack.json"


def up(env_file: Path, state: Path, project_dir: Path, port_overrides: dict[str, int]) -> dict:
    """Start the stack; returns what `stack.json` records. A service that fails stops the ones started."""
    if any(group_alive(item["group"]) for item in _services(state).values()):
        raise StackError(f"a stack is already running from {state}: stop it first (down)")
    state.mkdir(parents=True, exist_ok=True)
    record = {"services": {}, "env_file": str(env_file), "project_dir": str(project_dir)}
    services, starter = _starter(state, record, port_overrides)
    try:
        for name in start_order(services):
            starter.start(name, services)
            _write(state, record)
        starter.deploy(services)
    except BaseException:
        down(state)
        raise
    return record


def restart(state: Path, name: str) -> None:
    """Stop one service of the running stack and start it again on the same port and data (a database
    restarted under a running pipeline, a worker replaced)."""
    record = json.loads((state / STATE_FILE).read_text())
    if name not in record["services"]:
        raise StackError(f"no service {name!r} in {state}; there are {sorted(record['services'])}")
    ports = {service: item["port"] for service, item in record["services"].items() if item["port"] is not None}
    services, starter = _starter(state, record, ports)
    stop_group(record["services"][name]["group"], signal.Signals[record["services"][name]["stop_signal"]])
    starter.start(name, services)
    _write(state, record)


def kill(state: Path, name: str) -> None:
    """SIGKILL one service and everything it started (a worker's flow runs), as a crash or the kernel's
    out-of-memory killer would: to rehearse a failure; `restart` brings the service back."""
    services = _services(state)
    if name not in services:
        raise StackError(f"no service {name!r} in {state}; there are {sorted(services)}")
    kill_groups(family_groups(services[name]["group"]))


def _starter(state: Path, record: dict, port_overrides: dict[str, int]) -> tuple[dict[str, dict], ServiceStarter]:
    """compose.yaml's services with the env file of `record` substituted, and a starter placing them on this
    machine (the given ports, free ones for the databases otherwise); `record` gets the stack's addresses."""
    values = read_env_file(Path(record["env_file"]))
    services = load_services(values)
    placement = Placement(values.get("BIND_ADDRESS", "127.0.0.1"), _ports(services, port_overrides), state / "volumes")
    record["urls"] = _urls(placement)
    environment = _clean_environment(values)
    return services, ServiceStarter(placement, state, Path(record["project_dir"]), environment, record)


def down(state: Path) -> list[str]:
    """Stop every service of the stack in `state`, the last started first; returns their names."""
    stopped = []
    for name, item in reversed(list(_services(state).items())):
        stop_group(item["group"], signal.Signals[item["stop_signal"]])
        stopped.append(name)
    (state / STATE_FILE).unlink(missing_ok=True)
    return stopped


def status(state: Path) -> dict[str, str]:
    """Each recorded service: `running` or `stopped`."""
    return {name: "running" if group_alive(item["group"]) else "stopped" for name, item in _services(state).items()}


def _services(state: Path) -> dict[str, dict]:
    path = state / STATE_FILE
    return json.loads(path.read_text())["services"] if path.exists() else {}


def _write(state: Path, record: dict) -> None:
    (state / STATE_FILE).write_text(json.dumps(record, indent=2))


def _ports(services: dict[str, dict], overrides: dict[str, int]) -> dict[str, tuple[int, int]]:
    """Each listening service's (in-container, native) port: an override, else the port compose publishes
    on the host, else (the databases, which publish none) a free one."""
    ports = {}
    for name, service in services.items():
        inside = container_port(service)
        if inside is not None:
            published = [int(str(item).split(":")[-2]) for item in service.get("ports") or []]
            ports[name] = (inside, overrides.get(name) or (published[0] if published else _free_port()))
    unknown = set(overrides) - set(ports)
    if unknown:
        raise StackError(f"--port names services that do not listen: {sorted(unknown)}; these do: {sorted(ports)}")
    return ports


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _urls(placement: Placement) -> dict[str, str]:
    """The addresses people and clients use: what compose publishes, on this machine."""
    port = {name: here for name, (_, here) in placement.ports.items()}
    host = f"http://{placement.bind_address}"
    return {
        "prefect_api": f"{host}:{port['prefect-server']}/api",
        "prefect_ui": f"{host}:{port['prefect-server']}",
        "mlflow": f"{host}:{port['mlflow']}",
        "s3": f"{host}:{port['minio']}",
    }


def _clean_environment(values: dict[str, str]) -> dict[str, str]:
    """The environment every service starts from: this one without the stack's credentials (a service gets
    only those compose gives it) and without the Prefect, MLflow and S3 settings of the caller's shell,
    which would point a service elsewhere. This checkout comes first on PYTHONPATH, so that the workers
    and their flow runs import its code even where another copy of the project is installed."""
    dropped = re.compile(r"^(PREFECT_|MLFLOW_|AWS_)")
    env = {key: value for key, value in os.environ.items() if key not in values and not dropped.match(key)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(CHECKOUT), os.environ.get("PYTHONPATH")]))
    return env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=["up", "status", "restart", "kill", "down"])
    parser.add_argument("service", nargs="?", help="restart, kill: the compose service, e.g. mlflow-db")
    parser.add_argument("--state-dir", type=Path, default=CHECKOUT / ".stack", help="data, logs, stack.json")
    parser.add_argument("--env-file", type=Path, default=INFRA / ".env", help="the credentials (as for compose)")
    parser.add_argument("--project-dir", type=Path, default=CHECKOUT, help="where the workers run flow runs")
    parser.add_argument("--port", action="append", default=[], metavar="SERVICE=PORT", help="e.g. mlflow=5001")
    args = parser.parse_args(argv)
    state = args.state_dir.resolve()
    try:
        if args.action == "up":
            overrides = {name: int(port) for name, _, port in (item.partition("=") for item in args.port)}
            record = up(args.env_file.resolve(), state, args.project_dir.resolve(), overrides)
            print(json.dumps(record["urls"], indent=2))
        elif args.action == "restart":
            restart(state, args.service)
            print(f"restarted: {args.service}")
        elif args.action == "kill":
            kill(state, args.service)
            print(f"killed: {args.service}")
        elif args.action == "down":
            print("stopped: " + (", ".join(down(state)) or "nothing was running"))
        else:
            states = status(state)
            print("\n".join(f"{name}: {running}" for name, running in states.items()) or f"no stack in {state}")
    except StackError as error:
        print(f"stack: {error}", file=sys.stderr)
        return 1
    except subprocess.CalledProcessError as error:
        print(f"stack: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
