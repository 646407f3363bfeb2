"""A circuit breaker for a remote dependency that must never fail a request."""

from __future__ import annotations

import logging
import threading
import time

logger = logging.getLogger(__name__)


class CircuitBreaker:
    """Closed: calls go through. ``errors`` failures in a row open it: no calls for ``cooldown``
    seconds, then one probe; its success closes it, its failure opens it again."""

    def __init__(self, errors: int, cooldown: float, name: str) -> None:
        self.threshold, self.cooldown, self.name = errors, cooldown, name
        self.failures = 0
        self.open_until: float | None = None
        self.lock = threading.Lock()

    @property
    def is_open(self) -> bool:
        return self.open_until is not None

    def allow(self) -> bool:
        with self.lock:
            if self.open_until is None:
                return True
            if time.monotonic() >= self.open_until:  # half-open: this call is the probe
                self.open_until = time.monotonic() + self.cooldown
                return True
            return False

    def success(self) -> None:
        with self.lock:
            if self.open_until is not None:
                logger.info("%s answers again: circuit breaker closed", self.name)
            self.failures, self.open_until = 0, None

    def failure(self, error: Exception) -> None:
        with self.lock:
            self.failures += 1
            if self.failures >= self.threshold and self.open_until is None:
                logger.warning("%s failed %d times in a row (%s): circuit breaker open, requests compute "
                               "without it; probing again in %.1f s", self.name, self.failures,
                               str(error).strip() or type(error).__name__, self.cooldown)
            if self.failures >= self.threshold:
                self.open_until = time.monotonic() + self.cooldown
