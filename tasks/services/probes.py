"""Probing a service: one short HTTP request that says whether it answers, and why not in one line.

A service "answers" when it returns any HTTP response below 500: an S3 endpoint refuses an unsigned
request with 403 and a server behind authentication with 401, and both are up. The preflight check
(tasks/preflight.py) probes every configured service before work starts; an outage in the middle of a run
(tasks/services/service_outages.py) probes the tracking server before waiting on it.
"""

from __future__ import annotations

import socket
import ssl
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass

PROBE_TIMEOUT_S = 3.0
HTTP_SCHEMES = ("http://", "https://")


@dataclass(frozen=True)
class Service:
    """A service that will be used: what it is, its URL, the setting that points there, where to probe."""

    name: str
    url: str
    setting: str
    probe_path: str = ""

    @property
    def probe_url(self) -> str:
        return self.url.rstrip("/") + self.probe_path if self.probe_path else self.url


class ServiceUnreachableError(ConnectionError):
    """A configured service did not answer; the message is one line naming each such service."""


def check_services(services: Iterable[Service], timeout_s: float = PROBE_TIMEOUT_S) -> None:
    """Probe `services` at once; raise ServiceUnreachableError naming every one that did not answer."""
    unique = list({service.probe_url: service for service in services}.values())
    failures = [
        f"cannot reach the {service.name} at {service.url} (set by {service.setting}): {reason}"
        for service, reason in zip(unique, probe_all(unique, timeout_s))
        if reason is not None
    ]
    if failures:
        raise ServiceUnreachableError("; ".join(failures))


def probe_all(services: list[Service], timeout_s: float) -> list[str | None]:
    """`probe` of each service in its own daemon thread, all within one deadline.

    Threads rather than a sequence: a host name that does not resolve can block longer than the socket
    timeout (name resolution ignores it), and a daemon thread left blocked there does not hold up exit.
    """
    results: dict[int, str | None] = {}

    def run(index: int, service: Service) -> None:
        results[index] = probe(service, timeout_s)

    threads = [threading.Thread(target=run, args=item, daemon=True) for item in enumerate(services)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + timeout_s + 1.0
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    no_answer = f"no answer within {timeout_s:g} s"
    return [results.get(index, no_answer) for index in range(len(services))]


def probe(service: Service, timeout_s: float) -> str | None:
    """None when the service answered with an HTTP status below 500, else why it did not."""
    try:
        with urllib.request.urlopen(service.probe_url, timeout=timeout_s):
            return None
    except urllib.error.HTTPError as error:
        return None if error.code < 500 else f"it answered HTTP {error.code}"
    except urllib.error.URLError as error:
        return failure_reason(error.reason, timeout_s)
    except (OSError, ValueError) as error:  # a timeout while reading, or a malformed URL
        return failure_reason(error, timeout_s)


def failure_reason(error: object, timeout_s: float) -> str:
    """A short human reason for a failed connection."""
    if isinstance(error, ConnectionRefusedError):
        return "connection refused (nothing listens on that port)"
    if isinstance(error, socket.gaierror):
        return f"host name not found ({error.strerror or error})"
    if isinstance(error, TimeoutError):
        return f"no answer within {timeout_s:g} s"
    if isinstance(error, ssl.SSLError):
        return f"TLS error ({error})"
    return str(error) or type(error).__name__
