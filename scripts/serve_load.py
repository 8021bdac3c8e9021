"""A bounded burst of good and bad chat requests against `mlflow models serve`, with the server's memory.

    python3 scripts/serve_load.py --model MODEL [--url URL] [--requests 200] [--concurrency 200]
        [--bad-fraction 0.25] [--max-tokens 8] [--rounds 1] [--workers 1] [--json FILE]

The registered chat model, served with `mlflow models serve`, should answer 200 concurrent
requests, good ones and malformed or oversized ones, with clear 4xx errors, no crash, memory bounded
and every good request answered. This script does that and reports what happened:
1. starts `mlflow models serve -m MODEL` (a saved model directory or a `models:/name@alias` URI; the
   registry is MLFLOW_TRACKING_URI's) on a free loopback port, in a session of its own, its output in
   a log file; or, with `--url`, targets a server already running (then its memory is not sampled);
2. sends `--requests` requests, `--bad-fraction` of them bad, in a shuffled seeded order, from
   `--concurrency` threads, all started at once: at most that many in flight, no retries. A good
   request asks for `--max-tokens` tokens with its own seed; a bad one is one of BAD_KINDS in turn
   (malformed JSON, missing or mistyped fields, an unknown role, a billion max_tokens, a prompt longer
   than the context, a flood of characters, a body that is not an object). `--rounds` repeats the
   burst, so that memory that grows with every burst shows;
3. samples the resident memory of the server's process tree (psutil if installed, else /proc) every
   SAMPLE_INTERVAL_S: before the first burst, its peak, and after each burst once the server is idle;
4. prints the answers by status, each failure (a good request not answered 200 with a chat completion,
   a bad one not refused with a 4xx, no answer at all), the memory figures, the latencies (p50, p90,
   p99, max) of good and bad requests, and whether the server still answers /ping; with `--json`,
   writes the same as JSON. Exit status 1 when anything failed or the server died.

What bounds it: the policy generates one request at a time (tasks/serving/chat_policy.py), and MLflow's scoring
server runs each request in its default thread pool (min(32, cores + 4) threads), so a burst is answered
one generation after another, bad requests queued among the good ones (MLflow reads and checks a request
in the same pool), and a request still waiting when the server's request timeout runs out (60 s unless
`mlflow models serve --timeout`, here `--server-timeout`) is answered 504. Memory stays at one request's
generation plus the queued bodies. README.md ("Serving") has the figures measured on the tiny model.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

SAMPLE_INTERVAL_S = 0.1
START_TIMEOUT_S = 300.0
SETTLE_S = 2.0  # after a burst, before "after" memory is read: the server's threads finish and free
STOP_TIMEOUT_S = 10.0
MIB = 1024 * 1024
HELLO = [{"role": "user", "content": "Say hello."}]

# name -> the body of a request the server must refuse with a 4xx
BAD_KINDS: dict[str, Callable[[], Any]] = {
    "malformed JSON": lambda: b'{"messages": [',
    "no messages": lambda: {"max_tokens": 4},
    "messages not a list": lambda: {"messages": "hello"},
    "message without content": lambda: {"messages": [{"role": "user"}]},
    "unknown role": lambda: {"messages": [{"role": "robot", "content": "hi"}]},
    "max_tokens a string": lambda: {"messages": HELLO, "max_tokens": "8"},
    "a billion max_tokens": lambda: {"messages": HELLO, "max_tokens": 10**9},
    "temperature 3": lambda: {"messages": HELLO, "temperature": 3},
    "prompt longer than the context": lambda: {"messages": [{"role": "user", "content": "hello " * 3000}]},
    "a flood of characters": lambda: {"messages": [{"role": "user", "content": "x" * 200_000}]},
    "not an object": lambda: ["not", "an", "object"],
}


@dataclass(frozen=True)
class Probe:
    """One request to send: what kind, its body, whether the server should answer it."""

    kind: str
    body: bytes
    good: bool


@dataclass
class Answer:
    """What came back for one probe."""

    kind: str
    good: bool
    status: int | None  # None: no HTTP answer (refused connection, reset, timeout)
    latency_s: float
    problem: str | None = None  # why this answer is a failure, if it is one


@dataclass
class Memory:
    """The server process tree's resident memory, in MiB."""

    before: float = 0.0
    peak: float = 0.0
    after_each_round: list[float] = field(default_factory=list)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a saved pyfunc directory or a models:/ URI, served here")
    parser.add_argument("--url", help="a server already running (http://host:port); --model is then ignored")
    parser.add_argument("--requests", type=int, default=200, help="requests per round (default 200)")
    parser.add_argument("--concurrency", type=int, default=200, help="requests in flight at most (default 200)")
    parser.add_argument("--bad-fraction", type=float, default=0.25, help="share of bad requests (default 0.25)")
    parser.add_argument("--max-tokens", type=int, default=8, help="max_tokens of a good request (default 8)")
    parser.add_argument("--rounds", type=int, default=1, help="bursts, one after another (default 1)")
    parser.add_argument("--workers", type=int, default=1, help="the server's uvicorn workers (default 1)")
    parser.add_argument(
        "--server-timeout", type=int, default=60, help="the server's request timeout, s (default 60, MLflow's)"
    )
    parser.add_argument("--request-timeout", type=float, default=300.0, help="client timeout per request, s")
    parser.add_argument("--seed", type=int, default=0, help="seeds the order and the good requests' seeds")
    parser.add_argument("--json", type=Path, help="also write the report to this file as JSON")
    args = parser.parse_args(argv)
    if (args.model is None) == (args.url is None):
        parser.error("give --model (a model to serve) or --url (a server already running), one of them")
    if not 0 <= args.bad_fraction <= 1:
        parser.error(f"--bad-fraction must be within 0 and 1, got {args.bad_fraction}")
    return args


def probes(count: int, bad_fraction: float, max_tokens: int, seed: int) -> list[Probe]:
    """`count` probes, round(count * bad_fraction) of them bad (BAD_KINDS in turn), in a seeded order."""
    bad_count = round(count * bad_fraction)
    kinds = list(BAD_KINDS)
    made = [bad_probe(kinds[index % len(kinds)]) for index in range(bad_count)]
    for index in range(count - bad_count):
        request = {"messages": [{"role": "user", "content": f"Say hello to number {index}."}],
                   "max_tokens": max_tokens, "temperature": 0.7, "seed": seed * count + index}  # fmt: skip
        made.append(Probe("good", json.dumps(request).encode(), good=True))
    random.Random(seed).shuffle(made)
    return made


def bad_probe(kind: str) -> Probe:
    body = BAD_KINDS[kind]()
    return Probe(kind, body if isinstance(body, bytes) else json.dumps(body).encode(), good=False)


def tree_rss(pid: int) -> int:
    """Resident bytes of process `pid` and its descendants (0 once it is gone)."""
    try:
        import psutil
    except ImportError:
        return proc_tree_rss(pid)
    try:
        root = psutil.Process(pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for process in processes:
        try:
            total += process.memory_info().rss
        except psutil.NoSuchProcess:
            pass  # ended while we looked
    return total


def proc_tree_rss(pid: int) -> int:
    """`tree_rss` from /proc, for machines without psutil."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry.name))
    total, todo = 0, [pid]
    while todo:
        current = todo.pop()
        todo += children.get(current, [])
        try:
            status = (Path("/proc") / str(current) / "status").read_text()
        except OSError:
            continue
        total += next((int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmRSS:")), 0)
    return total


class RssSampler:
    """Samples `tree_rss(pid)` every SAMPLE_INTERVAL_S in a thread; keeps the peak."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak = 0
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self.sample, daemon=True)

    def sample(self) -> None:
        while not self.stopping.is_set():
            self.peak = max(self.peak, tree_rss(self.pid))
            self.stopping.wait(SAMPLE_INTERVAL_S)

    def __enter__(self) -> RssSampler:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopping.set()
        self.thread.join()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def http_status(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code
    except (OSError, urllib.error.URLError):
        return None


def start_server(model: str, workers: int, timeout_s: int, log_path: Path) -> tuple[subprocess.Popen[bytes], str]:
    """`mlflow models serve` on `model` in a session of its own, answering /ping; the process and URL."""
    port = free_port()
    command = [sys.executable, "-m", "mlflow", "models", "serve", "-m", model, "--env-manager", "local",
               "--host", "127.0.0.1", "--port", str(port),
               "--workers", str(workers), "--timeout", str(timeout_s)]  # fmt: skip
    with log_path.open("wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   start_new_session=True)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT_S
    while http_status(f"{url}/ping") != 200:
        if process.poll() is not None or time.monotonic() > deadline:
            stop_server(process)
            tail = log_path.read_text(errors="replace")[-3000:]
            raise SystemExit(f"serve_load: the server did not come up (log {log_path}):\n{tail}")
        time.sleep(0.5)
    return process, url


def stop_server(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM the server's process group, SIGKILL what is left after STOP_TIMEOUT_S."""
    for signal_number in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, signal_number)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            continue


def send(url: str, probe: Probe, timeout_s: float) -> Answer:
    """POST one probe to /invocations and judge the answer."""
    request = urllib.request.Request(
        f"{url}/invocations", data=probe.body, headers={"Content-Type": "application/json"}
    )
    started = time.monotonic()
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            status, text = response.status, response.read()
    except urllib.error.HTTPError as error:
        status, text = error.code, error.read()
    except OSError as error:
        return Answer(probe.kind, probe.good, None, time.monotonic() - started, f"no answer: {error!r}")
    answer = Answer(probe.kind, probe.good, status, time.monotonic() - started)
    answer.problem = judge(probe, status, text)
    return answer


def judge(probe: Probe, status: int, text: bytes) -> str | None:
    """Why this answer fails the probe, or None: a good request needs 200 and a chat completion, a bad one
    a 4xx with a message."""
    try:
        body = json.loads(text)
    except ValueError:
        return f"HTTP {status}, not JSON: {text[:200]!r}"
    if probe.good:
        if status != 200 or not isinstance(body, dict) or body.get("object") != "chat.completion":
            return f"HTTP {status}: {str(body)[:200]}"
        return None
    if not 400 <= status < 500 or not isinstance(body, dict) or not body.get("message"):
        return f"HTTP {status} for a bad request: {str(body)[:200]}"
    return None


def burst(url: str, sent: list[Probe], concurrency: int, timeout_s: float) -> list[Answer]:
    """Send every probe, `concurrency` at a time at most, all threads started together."""
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        return list(pool.map(lambda probe: send(url, probe, timeout_s), sent))


def percentiles(values: list[float]) -> dict[str, float]:
    """p50, p90, p99 and max (nearest rank), in seconds; empty for no values."""
    if not values:
        return {}
    ordered = sorted(values)
    rank = lambda share: ordered[min(len(ordered) - 1, max(0, round(share * len(ordered)) - 1))]  # noqa: E731
    return {"p50": rank(0.5), "p90": rank(0.9), "p99": rank(0.99), "max": ordered[-1]}


def report(answers: list[Answer], memory: Memory | None, alive: bool, seconds: float) -> dict[str, Any]:
    """The figures the script prints and writes."""
    failures = [asdict(answer) for answer in answers if answer.problem is not None]
    return {
        "requests": len(answers),
        "good": sum(answer.good for answer in answers),
        "bad": sum(not answer.good for answer in answers),
        "by_status": {
            str(status): count for status, count in sorted(Counter(answer.status or 0 for answer in answers).items())
        },
        "good_answered": sum(answer.good and answer.problem is None for answer in answers),
        "bad_refused_4xx": sum(not answer.good and answer.problem is None for answer in answers),
        "failures": failures,
        "latency_good_s": percentiles([answer.latency_s for answer in answers if answer.good]),
        "latency_bad_s": percentiles([answer.latency_s for answer in answers if not answer.good]),
        "memory_mib": asdict(memory) if memory is not None else None,
        "server_alive": alive,
        "wall_s": seconds,
    }


def print_report(figures: dict[str, Any]) -> None:
    print(
        f"requests: {figures['requests']} ({figures['good']} good, {figures['bad']} bad) in {figures['wall_s']:.1f} s"
    )
    print(
        "answers by status: "
        + ", ".join(f"{status if status != '0' else 'none'}: {count}" for status, count in figures["by_status"].items())
    )
    print(
        f"good answered: {figures['good_answered']}/{figures['good']}; bad refused with 4xx: "
        f"{figures['bad_refused_4xx']}/{figures['bad']}"
    )
    for name in ("latency_good_s", "latency_bad_s"):
        if figures[name]:
            print(
                f"{name.removesuffix('_s').replace('_', ' ')}: "
                + ", ".join(f"{key} {value:.3f} s" for key, value in figures[name].items())
            )
    memory = figures["memory_mib"]
    if memory is not None:
        after = ", ".join(f"{value:.0f}" for value in memory["after_each_round"])
        print(f"server RSS (MiB): before {memory['before']:.0f}, peak {memory['peak']:.0f}, after each round {after} "
              f"(growth {memory['after_each_round'][-1] - memory['before']:+.0f})")  # fmt: skip
    print(f"server alive after the load: {'yes' if figures['server_alive'] else 'NO'}")
    print(f"failures: {len(figures['failures'])}")
    for failure in figures["failures"][:20]:
        print(f"  {failure['kind']}: {failure['problem']}")


def run_rounds(args: argparse.Namespace, url: str, pid: int | None) -> tuple[list[Answer], Memory | None]:
    """`args.rounds` bursts; the memory figures when the server's process is known."""
    memory = Memory(before=tree_rss(pid) / MIB) if pid is not None else None
    answers: list[Answer] = []
    for number in range(args.rounds):
        sent = probes(args.requests, args.bad_fraction, args.max_tokens, args.seed + number)
        if pid is None:
            answers += burst(url, sent, args.concurrency, args.request_timeout)
            continue
        with RssSampler(pid) as sampler:
            answers += burst(url, sent, args.concurrency, args.request_timeout)
            time.sleep(SETTLE_S)
        memory.peak = max(memory.peak, sampler.peak / MIB)
        memory.after_each_round.append(tree_rss(pid) / MIB)
    return answers, memory


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    process = None
    with tempfile.TemporaryDirectory(prefix="serve-load-") as directory:
        if args.url is None:
            process, url = start_server(args.model, args.workers, args.server_timeout, Path(directory) / "serve.log")
        else:
            url = args.url.rstrip("/")
        try:
            started = time.monotonic()
            answers, memory = run_rounds(args, url, process.pid if process is not None else None)
            seconds = time.monotonic() - started
            alive = http_status(f"{url}/ping") == 200 and (process is None or process.poll() is None)
        finally:
            if process is not None:
                stop_server(process)
    figures = report(answers, memory, alive, seconds)
    print_report(figures)
    if args.json is not None:
        args.json.write_text(json.dumps(figures, indent=2) + "\n", encoding="utf-8")
    return 0 if alive and not figures["failures"] else 1


if __name__ == "__main__":
    sys.exit(main())
