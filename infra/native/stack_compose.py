"""infra/compose.yaml read as the native stack's settings, so that the two cannot drift apart.

Compose is the one source: each service's command and environment are taken from it, with infra/.env
substituted the way Compose does (`${NAME:?message}`, `${NAME:-default}`), and then moved from containers
to one machine: a service's host name and port (`mlflow:5000`, `prefect-db:5432`) become
`127.0.0.1:<its native port>`, a listen address of 0.0.0.0 the bind address, a volume's mount path a
folder of the state directory, and the executables `prefect` and `mlflow` this interpreter's modules.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml
from stack_processes import StackError

INFRA = Path(__file__).resolve().parents[1]
COMPOSE = INFRA / "compose.yaml"
# `${NAME}`, `${NAME:?message}` (required) and `${NAME:-default}`, as Compose interpolates them.
_VARIABLE = re.compile(r"\$\{(\w+)(?::([?-])([^}]*))?\}")
# Executables of the containers that are Python modules here: run with this interpreter, so that the
# servers and workers import the packages this launcher runs with, not whatever PATH finds first.
PYTHON_MODULES = ("prefect", "mlflow")


def read_env_file(path: Path) -> dict[str, str]:
    """`NAME=value` lines of an env file (comments and blank lines skipped), as Compose reads infra/.env."""
    values = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            name, separator, value = line.partition("=")
            if not separator:
                raise StackError(f"{path}: line {line!r} is not NAME=value")
            values[name.strip()] = value.strip().strip("'\"")
    return values


def substitute(text: str, values: dict[str, str]) -> str:
    """`text` with every `${...}` replaced from `values`; a required one that is missing stops, with its message."""

    def replace(match: re.Match) -> str:
        name, kind, argument = match.groups()
        if values.get(name):
            return values[name]
        if kind == "?":
            raise StackError(f"{name}: {argument}")
        return argument if kind == "-" else ""

    return _VARIABLE.sub(replace, text)


def load_services(values: dict[str, str]) -> dict[str, dict]:
    """The services of compose.yaml with `values` substituted (YAML anchors, such as the workers', resolved)."""
    return yaml.safe_load(substitute(COMPOSE.read_text(), values))["services"]


def start_order(services: dict[str, dict]) -> list[str]:
    """The services in an order that starts each after everything it `depends_on`, as Compose does."""
    ordered: list[str] = []

    def visit(name: str) -> None:
        if name not in ordered:
            for dependency in services[name].get("depends_on", {}):
                visit(dependency)
            ordered.append(name)

    for name in services:
        visit(name)
    return ordered


def environment(service: dict) -> dict[str, str]:
    """A service's `environment` as strings (Compose accepts a mapping whose values may be numbers)."""
    return {name: str(value) for name, value in (service.get("environment") or {}).items()}


# The port the databases listen on inside their containers (they publish none: only the servers reach them).
POSTGRES_PORT = 5432


def container_port(service: dict) -> int | None:
    """The port a service listens on inside its container: the first one it publishes, or PostgreSQL's."""
    ports = service.get("ports") or []
    if ports:
        return int(str(ports[0]).rsplit(":", 1)[1])
    return POSTGRES_PORT if str(service.get("image", "")).startswith("postgres:") else None


@dataclass(frozen=True)
class Placement:
    """Where the services are on this machine: the bind address, each listening service's port inside its
    container and here (by service name), and the folder under which each named volume lives."""

    bind_address: str
    ports: dict[str, tuple[int, int]]
    volumes: Path

    def localize(self, value: str, service: dict) -> str:
        """One command argument or environment value of `service`, moved from the containers to this machine."""
        for name, (inside, here) in self.ports.items():
            value = re.sub(rf"(?<![\w.-]){re.escape(name)}:{inside}(?!\d)", f"127.0.0.1:{here}", value)
        for mount in service.get("volumes") or []:
            source, target = str(mount).split(":")[:2]
            # A named volume is a folder of the state folder; a mounted file (./x) is read in place in infra/.
            local = INFRA / source if source.startswith(".") else self.volumes / source
            value = value.replace(target, str(local))
        return self.bind_address if value == "0.0.0.0" else value

    def command(self, service: dict, own_name: str) -> list[str]:
        """The service's command, localized; its own port argument becomes its native port."""
        command = [self._own_port(self.localize(str(part), service), own_name) for part in service["command"]]
        if command[0] in PYTHON_MODULES:
            command = [sys.executable, "-m", *command]
        return command

    def environment(self, service: dict, own_name: str) -> dict[str, str]:
        """The service's environment, localized; its own port setting becomes its native port."""
        return {
            name: self._own_port(self.localize(value, service), own_name)
            for name, value in environment(service).items()
        }

    def _own_port(self, value: str, own_name: str) -> str:
        if own_name in self.ports and value == str(self.ports[own_name][0]):
            return str(self.ports[own_name][1])
        return value
