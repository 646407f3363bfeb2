"""Shared by the serving benchmarks: wait for a server to report healthy; run a `duoserve serve`."""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable

import httpx


def wait_healthy(url: str, timeout: float, still_running: Callable[[], bool] = lambda: True) -> float:
    """Poll ``url`` until it answers 200; returns the seconds waited. Raises if the server
    process stops (``still_running`` is false) or ``timeout`` passes."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if not still_running():
            raise RuntimeError(f"the server behind {url} exited")
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return time.monotonic() - start
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} not healthy in {timeout:.0f} s")


class DuoserveServer:
    """``duoserve serve --port PORT FLAGS`` in its own process group, healthy on return (its log
    in a temporary file); ``metric`` sums a series of its /metrics."""

    def __init__(self, flags: list[str], port: int, timeout: float = 900) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.log = tempfile.NamedTemporaryFile("w", suffix=".log", delete=False)
        self.proc = subprocess.Popen(["duoserve", "serve", "--port", str(port), "--no-access-log", *flags],
                                     stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            self.startup_s = wait_healthy(f"{self.url}/health", timeout, lambda: self.proc.poll() is None)
        except RuntimeError as exc:
            raise RuntimeError(f"{exc}; log: {self.log.name}") from None

    def metric(self, series: str) -> float:
        """The sum of a series' samples: ``name`` (any labels) or ``name{label="value"}`` (those)."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        total = 0.0
        for line in text.splitlines():
            head = line.split(" ")[0]
            if head == series or ("{" not in series and head.startswith(series + "{")):
                total += float(line.split()[-1])
        return total

    def cpu_seconds(self) -> float:
        """User + system CPU seconds of the server's processes so far (every process of its
        group: the API process and the engines it launched; Linux's /proc)."""
        ticks, per_second = 0, os.sysconf("SC_CLK_TCK")
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:   # gone meanwhile
                continue
            if int(fields[2]) == self.proc.pid:   # its process group (the server leads its own)
                ticks += int(fields[11]) + int(fields[12])
        return ticks / per_second

    def stop(self) -> None:
        os.killpg(self.proc.pid, signal.SIGTERM)
        self.proc.wait(60)
