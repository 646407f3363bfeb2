"""Fair share per tenant: virtual token counters (VTC; Sheng et al., "Fairness in Serving Large
Language Models", OSDI '24), for ``--scheduling-policy fair``.

Each tenant has a counter of the tokens it has been served, weighted as the paper's are (a
computed prompt token costs 1, a generated token 2: it takes a pass of its own) and divided by
the tenant's weight (``--tenant-weights``). Waiting requests are taken in the order VTC picks
them: the tenant with the lowest counter first, its counter advanced by the prompt it would be
charged, then the lowest again; within a tenant, in the queue's own order. A tenant sending ten
times the others' requests so gets its share of the tokens while the others wait, and all of
what they leave.

A tenant arriving with nothing in the engine starts ``ARRIVAL_CREDIT`` below the lowest counter
among the tenants that have (with none, at the highest of all): idling earns no more credit than
that, or a tenant back from a pause would take the whole server until its counter caught up.

Preemption for fair share (the batch full, or blocks short) needs a waiting tenant's counter
``MARGIN`` below the running one's: two tenants sharing a full batch take turns every ``MARGIN``
tokens or so instead of preempting each other at every step as their counters pass. The arrival
credit is larger, so that a tenant arriving at a server full of another's requests gets a seat
at the next step, not once the other has been served ``MARGIN`` more.
"""

from __future__ import annotations

import heapq
from collections import Counter, deque
from collections.abc import Iterable

from duoserve.core.request import Request

PROMPT_TOKEN_COST = 1.0
OUTPUT_TOKEN_COST = 2.0
MARGIN = 512.0            # a step's token budget: the hysteresis of a preemption
ARRIVAL_CREDIT = 2 * MARGIN
KEEP_IDLE_TENANTS = 1024   # counters of idle tenants kept (above the floor) before the oldest go


def tenant_of(request: Request) -> str:
    return request.params.tenant


class FairShare:
    def __init__(self, weights: Iterable[tuple[str, float]] = ()) -> None:
        self.weights = dict(weights)
        self.counters: dict[str, float] = {}
        self.active: Counter[str] = Counter()   # tenant -> its requests in the engine

    def weight(self, tenant: str) -> float:
        return self.weights.get(tenant, 1.0)

    def counter(self, tenant: str) -> float:
        return self.counters.get(tenant, 0.0)

    def arrive(self, request: Request) -> None:
        """A request enters the engine (new, handed over, or another sample of one)."""
        tenant = tenant_of(request)
        if not self.active[tenant]:
            others = [self.counters.get(t, 0.0) for t, n in self.active.items() if n]
            floor = min(others) - ARRIVAL_CREDIT if others else max(self.counters.values(), default=0.0)
            self.counters[tenant] = max(self.counters.get(tenant, 0.0), floor)
            if len(self.counters) > KEEP_IDLE_TENANTS + len(others):
                self._forget_idle(floor)
        self.active[tenant] += 1

    def leave(self, request: Request) -> None:
        tenant = tenant_of(request)
        self.active[tenant] -= 1
        if self.active[tenant] <= 0:
            del self.active[tenant]

    def _forget_idle(self, floor: float) -> None:
        """Idle tenants at or below ``floor`` would be lifted to it on arrival: their counters go."""
        for tenant in [t for t, c in self.counters.items() if c <= floor and not self.active[t]]:
            del self.counters[tenant]

    def outranks(self, waiting: Request, running: Request) -> bool:
        """Whether ``waiting``'s tenant is served enough less than ``running``'s to preempt it."""
        return self.counter(tenant_of(waiting)) < self.counter(tenant_of(running)) - MARGIN

    def charge(self, request: Request, prompt_tokens: int, output_tokens: int) -> None:
        tenant = tenant_of(request)
        cost = PROMPT_TOKEN_COST * prompt_tokens + OUTPUT_TOKEN_COST * output_tokens
        self.counters[tenant] = self.counters.get(tenant, 0.0) + cost / self.weight(tenant)

    def order(self, requests: Iterable[Request]) -> list[Request]:
        """``requests`` in the order VTC picks them (a tenant's own in their given order)."""
        by_tenant: dict[str, deque[Request]] = {}
        for request in requests:
            by_tenant.setdefault(tenant_of(request), deque()).append(request)
        if len(by_tenant) <= 1:
            return [r for queue in by_tenant.values() for r in queue]
        heap = [(self.counter(t), i, t) for i, t in enumerate(by_tenant)]
        heapq.heapify(heap)
        ordered = []
        while heap:
            counter, i, tenant = heapq.heappop(heap)
            request = by_tenant[tenant].popleft()
            ordered.append(request)
            if by_tenant[tenant]:
                prompt = max(request.num_prompt_tokens - request.num_computed_tokens, 0)
                heapq.heappush(heap, (counter + PROMPT_TOKEN_COST * prompt / self.weight(tenant), i, tenant))
        return ordered
