"""What an engine's role changes in scheduling, chosen once at start.

``RolePolicy`` is the colocated and decode engines' (their prompts in arrival order, a
prefilled request decodes on where it is). ``PrefillOnly`` is a prefill engine's: a
request stops at its first token and its KV is leased to a decode engine::

    WAITING -> PREFILLING -> KV_LEASED --ack--> FINISHED_STOPPED
                                       --lease_timeout--> FINISHED_ERROR

The leased blocks stay held (out of the running set) until the decode side acknowledges
them (``release``) or the lease expires (``expired``); the engine's handoff ships each newly
leased request (``drain_leased``). No torch here.
"""

from __future__ import annotations

import time
from collections import deque

from duoserve.core.kv_cache_manager import KVCacheManager
from duoserve.core.request import Request, RequestStatus

S = RequestStatus
PREFILL_AGING_SECONDS = 5.0   # prefill role: a request waiting longer than this goes first


class RolePolicy:
    """Colocated and decode engines: FIFO admission, nothing leased."""

    @property
    def num_leased(self) -> int:
        return 0

    def order(self, waiting: deque[Request], running: list[Request], token_budget: int) -> int:
        """Reorder the waiting and running requests; returns the budget to hold back from the
        running ones for waiting prompts. Here: arrival order, nothing held back."""
        return 0

    def after_prefill(self, request: Request) -> bool:
        """A prefilling request got a token and goes on; True when it leaves the running set."""
        request.move_to(S.RUNNING)
        return False

    def release(self, request_id: str) -> bool:
        """Give up a request's lease; False when it holds none."""
        return False

    def expired(self, now: float) -> list[tuple[str, str]]:
        """(request id, why) of every lease past its deadline."""
        return []

    def drain_leased(self) -> list[tuple[Request, list[int]]]:
        """Requests leased since the last call, with the blocks that hold their KV."""
        return []


class PrefillOnly(RolePolicy):
    """A prefill engine: shortest prompt first; at its first token a request's KV is leased."""

    def __init__(self, kv: KVCacheManager, lease_timeout: float) -> None:
        self.kv = kv
        self.lease_timeout = lease_timeout
        self.leases: dict[str, float] = {}                        # leased request id -> deadline
        self.newly_leased: list[tuple[Request, list[int]]] = []   # (request, its blocks) to ship

    @property
    def num_leased(self) -> int:
        return len(self.leases)

    def order(self, waiting: deque[Request], running: list[Request], token_budget: int) -> int:
        """Shortest remaining prompt first, so a short prompt never queues behind a long one's
        chunks (there are no decodes here to keep fluid, only first tokens to hurry).

        Sorts the waiting and prefilling requests; returns the budget to hold back from the
        prefilling ones for the waiting prompts shorter than the longest of them, as many as
        fit whole (the prefilling ones always keep at least one token: nothing stalls).

        Aging bounds every wait: a request that arrived more than ``PREFILL_AGING_SECONDS`` ago
        goes before every younger one, oldest first, and at most half of a step is held back
        from it, so a long prompt cannot starve behind a steady stream of short ones, nor a short
        one wait for the whole of an aged long one.
        """
        now = time.monotonic()

        def remaining(request: Request) -> int:
            return request.num_tokens - request.num_computed_tokens

        def order(request: Request) -> tuple[bool, float]:
            aged = now - request.arrival_time >= PREFILL_AGING_SECONDS
            return (not aged, request.arrival_time if aged else remaining(request))

        if len(waiting) > 1:
            ordered = sorted(waiting, key=order)
            waiting.clear()
            waiting.extend(ordered)
        running.sort(key=order)
        if not waiting or not running:
            return 0
        limit = token_budget if order(running[0])[0] else token_budget // 2
        longest, reserved = remaining(running[-1]), 0
        for request in waiting:
            need = remaining(request)
            if need >= longest or reserved + need >= limit:
                break
            reserved += need
        return reserved

    def after_prefill(self, request: Request) -> bool:
        request.move_to(S.KV_LEASED)
        self.leases[request.request_id] = time.monotonic() + self.lease_timeout
        self.newly_leased.append((request, self.kv.block_ids(request.request_id)))
        return True

    def release(self, request_id: str) -> bool:
        return self.leases.pop(request_id, None) is not None

    def expired(self, now: float) -> list[tuple[str, str]]:
        return [(request_id, f"the decode engine did not acknowledge the KV of request {request_id} within "
                             f"{self.lease_timeout:g} s (--kv-lease-timeout); its blocks were freed")
                for request_id, deadline in self.leases.items() if now >= deadline]

    def drain_leased(self) -> list[tuple[Request, list[int]]]:
        leased, self.newly_leased = self.newly_leased, []
        return leased
