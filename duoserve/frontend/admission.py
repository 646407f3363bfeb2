"""Saying no in time: the frontend's caps on requests waiting for their first token, and what it
knows of each request's class (tenant and priority) for the metrics by class.

A request waits from the moment the server takes it until its first output (queued in an
engine, or its prompt being computed); then it runs until it ends. ``--max-waiting-per-tenant``
and ``--max-waiting`` refuse a new request once its tenant, or the whole server, has that many
waiting: the server answers 429 with a ``Retry-After`` of the seconds the waiting ones take to
start at the rate requests started over the last ``RATE_WINDOW_S`` seconds.
"""

from __future__ import annotations

import math
import time
from collections import Counter, deque
from dataclasses import dataclass

from duoserve.errors import DuoserveError
from duoserve.sampling_params import SamplingParams

RATE_WINDOW_S = 10.0
MAX_RETRY_AFTER_S = 60
MAX_CLASS_LABELS = 100   # tenants (and priorities) named in metrics; the rest are counted as "other"
ANONYMOUS = "anonymous"  # the label of requests with no tenant


class QueueFullError(DuoserveError):
    """A cap on waiting or in-flight requests is reached; ``retry_after`` seconds is a fair wait."""

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class QueueTimeoutError(DuoserveError):
    """The request waited past its ``timeout`` and was dropped before its prompt was computed."""

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after


@dataclass
class RequestClass:
    tenant: str      # as the request gave it (the caps count by it)
    label: str       # the tenant's metrics label
    priority: str    # the priority's metrics label
    params: SamplingParams | None = None   # what it asked for (traces)
    waiting: bool = True


class Admission:
    def __init__(self, max_waiting_per_tenant: int | None = None, max_waiting: int | None = None) -> None:
        self.max_waiting_per_tenant = max_waiting_per_tenant
        self.max_waiting = max_waiting
        self.classes: dict[str, RequestClass] = {}
        self.waiting: Counter[str] = Counter()     # tenant (as given) -> its requests waiting
        self.starts: deque[float] = deque()        # when requests got their first output, recently
        self.refused: Counter[str] = Counter()     # reason -> requests refused or dropped
        self._labels: dict[str, set[str]] = {"tenant": set(), "priority": set()}

    def label(self, value: str, kind: str = "tenant") -> str:
        """A metrics label for a tenant (or priority): the first MAX_CLASS_LABELS of each kind seen,
        then "other"."""
        value, seen = value or ANONYMOUS, self._labels[kind]
        if value in seen:
            return value
        if len(seen) < MAX_CLASS_LABELS:
            seen.add(value)
            return value
        return "other"

    def retry_after(self, num_waiting: int) -> int:
        """Seconds ``num_waiting`` requests take to start at the recent rate (1 to MAX_RETRY_AFTER_S)."""
        now = time.monotonic()
        while self.starts and self.starts[0] < now - RATE_WINDOW_S:
            self.starts.popleft()
        rate = len(self.starts) / RATE_WINDOW_S
        if rate <= 0:   # nothing started lately: no rate to go by
            return 1
        return max(1, min(MAX_RETRY_AFTER_S, math.ceil(num_waiting / rate)))

    def check(self, tenant: str) -> None:
        """Refuse (QueueFullError) a new request of ``tenant`` when a waiting cap is reached."""
        cap = self.max_waiting_per_tenant
        if cap is not None and self.waiting[tenant] >= cap:
            self.refused["tenant_waiting"] += 1
            raise QueueFullError(f"tenant {tenant or ANONYMOUS!r} has {self.waiting[tenant]} requests waiting "
                                 f"(--max-waiting-per-tenant {cap}); retry later",
                                 self.retry_after(self.waiting[tenant]))
        total = sum(self.waiting.values())
        if self.max_waiting is not None and total >= self.max_waiting:
            self.refused["server_waiting"] += 1
            raise QueueFullError(f"the server has {total} requests waiting (--max-waiting {self.max_waiting}); "
                                 "retry later", self.retry_after(total))

    def enter(self, request_id: str, params: SamplingParams) -> None:
        tenant = params.tenant
        self.classes[request_id] = RequestClass(tenant, self.label(tenant), self.label(str(params.priority), "priority"),
                                                params)
        self.waiting[tenant] += 1

    def started(self, request_id: str) -> None:
        cls = self.classes.get(request_id)
        if cls is not None and cls.waiting:
            cls.waiting = False
            self._unwait(cls.tenant)
            self.starts.append(time.monotonic())

    def leave(self, request_id: str) -> None:
        cls = self.classes.pop(request_id, None)
        if cls is not None and cls.waiting:
            self._unwait(cls.tenant)

    def _unwait(self, tenant: str) -> None:
        self.waiting[tenant] -= 1
        if self.waiting[tenant] <= 0:
            del self.waiting[tenant]

    def counts(self) -> dict[tuple[str, str], tuple[int, int]]:
        """(tenant label, priority label) -> (waiting, running)."""
        out: dict[tuple[str, str], list[int]] = {}
        for cls in self.classes.values():
            counts = out.setdefault((cls.label, cls.priority), [0, 0])
            counts[0 if cls.waiting else 1] += 1
        return {key: (w, r) for key, (w, r) in out.items()}
