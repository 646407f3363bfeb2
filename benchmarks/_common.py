"""Shared by the serving benchmarks: wait for a server to report healthy."""

from __future__ import annotations

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
