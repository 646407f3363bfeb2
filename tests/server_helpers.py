"""Start a real `duoserve serve` in a subprocess for tests, and find its engine child."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(x) for x in path.read_text().split()] if path.exists() else []


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split()[2] == "Z")


class Server:
    """``new_session``: the server leads its own process group, so a test can signal the group
    as a terminal's Ctrl-C would."""

    def __init__(self, *args: str, api_key: str | None = None, log: Path | None = None,
                 new_session: bool = False, wait_healthy: bool = True, wait_port: bool = True) -> None:
        """``wait_healthy``: return once /health says 200 (else once the port answers at all);
        ``wait_port=False``: return at once (the server may still be starting its engines)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        cmd = [sys.executable, "-m", "duoserve.cli", "serve", "--port", str(self.port), *args]
        if api_key:
            cmd += ["--api-key", api_key]
        self.log = open(log, "w") if log else subprocess.DEVNULL
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=new_session)
        if not wait_port:
            return
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}")
            try:
                status = httpx.get(f"{self.url}/health", timeout=1).status_code
                if status == 200 or not wait_healthy:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        self.stop()
        raise RuntimeError("server did not become healthy in 120 s")

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children first)."""
    found, todo = [], children(pid)
    while todo:
        found.append(todo.pop(0))
        todo += children(found[-1])
    return found


def engine_children(pid: int) -> list[int]:
    """The server's engine processes: forks of its fork server, named ``duoserve-<engine>``
    (multiprocessing adds the fork server and a resource tracker beside them)."""
    engines = []
    for c in descendants(pid):
        try:
            if Path(f"/proc/{c}/comm").read_text().startswith("duoserve-"):
                engines.append(c)
        except OSError:   # gone meanwhile
            continue
    return engines


def metric(url: str, name: str, labels: dict | None = None, headers: dict | None = None) -> float:
    """The sum of a /metrics series' samples that carry ``labels``."""
    text = httpx.get(f"{url}/metrics", headers=headers or {}, timeout=10).text
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in (labels or {}).items()):
                total += sample.value
    return total


def wait_metric(url: str, name: str, predicate, labels: dict | None = None, headers: dict | None = None,
                guard: float = 120.0) -> float:
    """Poll a series until ``predicate(value)`` holds (the engines' stats come once a second, later
    on a busy machine); returns the value. ``guard`` only turns a hang into a failure."""
    deadline = time.monotonic() + guard
    while True:
        value = metric(url, name, labels, headers)
        if predicate(value):
            return value
        assert time.monotonic() < deadline, f"{name}{labels or ''} still {value} after {guard:g}s"
        time.sleep(0.05)


IDLE_GAUGES = ("duoserve:num_requests_running", "duoserve:num_requests_waiting", "duoserve:num_requests_kv_leased",
               "duoserve:kv_cache_usage_ratio")


def wait_gauges_idle(url: str, within: float, headers: dict | None = None) -> float:
    """Seconds until every load gauge reads 0 (fails after ``within``)."""
    start = time.monotonic()
    while True:
        values = {name: metric(url, name, headers=headers) for name in IDLE_GAUGES}
        if not any(values.values()):
            return time.monotonic() - start
        assert time.monotonic() - start < within, f"gauges not idle after {within:g}s: {values}"
        time.sleep(0.05)
