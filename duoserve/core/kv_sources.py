"""Where a request's KV comes from when it is admitted: each source asked once, in order.

A request enters the running set from one of the scheduler's queues (waiting, swapped,
waiting for KV). Before it is given blocks, every source chosen at start is asked, in
order, what it holds of the request's KV past its computed tokens and past what the
sources before it found::

    | computed | hit 1 (shared blocks) | hit 2 (copied into new blocks) | to compute ... |
    0          ^ num_computed_tokens                                     ^ the step's chunk

A source answers a ``KVHit`` or None; a request that is not its kind (a waiting prompt for
the swap space) gets None after a check or two. Only the first hit may share blocks as they
are (the prefix cache's); the others' KV is copied into the request's new blocks before the
step's forward, by the model runner, from what ``fill`` writes into the step's plan. ``fill``
runs only once the blocks are allocated: a request that does not fit is asked again later.

Sources here: ``PrefixCacheSource`` (this engine's cached blocks), ``SwapSource`` (the host
copy of a swapped-out request), ``TransferSource`` (KV a prefill engine sent). The shared KV
store's source uses torch and lives in ``duoserve.kv.store``; the engine's builder injects it.
No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from duoserve.core.block_pool import Block
from duoserve.core.kv_cache_manager import KVCacheManager
from duoserve.core.outputs import SchedulerOutput
from duoserve.core.request import Request, RequestStatus
from duoserve.core.swap_space import SwapCost, SwapSpace


@dataclass(slots=True)
class KVHit:
    """What one source holds of a request's KV, right after what earlier sources found."""
    num_tokens: int                      # tokens past num_computed_tokens (and earlier hits) it provides
    shared_blocks: list[Block] = field(default_factory=list)  # taken as they are, no copy (first hit only)
    payload: object = None               # what ``fill`` hands the runner to copy in
    cached: bool = False                 # counts in the request's num_cached_tokens (cache hits)


class KVSource(Protocol):
    def find(self, request: Request, num_found: int) -> KVHit | None:
        """What this source holds of ``request``'s KV after ``num_found`` tokens found before it."""

    def fill(self, request: Request, hit: KVHit, block_ids: list[int], plan: SchedulerOutput) -> None:
        """The request got its blocks (``block_ids``: its new ones, from the first this hit fills):
        put the copies the runner must make before the forward into ``plan``."""


def takes_cached_kv(request: Request, kv: KVCacheManager) -> bool:
    """Whether a waiting request may start from cached KV (the prefix cache's or the store's).

    Prompt log-probabilities and a mean-pooled embedding need every prompt position run through
    the model: such a request takes no hits (its blocks are still cached for others). A forked
    sample holds blocks already.
    """
    return (request.status is RequestStatus.WAITING and request.prompt_logprobs is None
            and request.params.pooling != "mean" and request.request_id not in kv.req_blocks)


class PrefixCacheSource:
    """This engine's own cached blocks that start the request's tokens, shared as they are."""

    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv

    def find(self, request: Request, num_found: int) -> KVHit | None:
        if num_found or not takes_cached_kv(request, self.kv):
            return None
        blocks = self.kv.find_cached_prefix(request)
        return KVHit(len(blocks) * self.kv.block_size, blocks, cached=True) if blocks else None

    def fill(self, request: Request, hit: KVHit, block_ids: list[int], plan: SchedulerOutput) -> None:
        pass  # shared blocks: nothing to copy


class SwapSource:
    """The swap space: where a preempted request's KV waits in host memory (``SwapSpace``), and
    the choice between swapping it out and computing it again (``SwapCost``)."""

    def __init__(self, space: SwapSpace, cost: SwapCost) -> None:
        self.space, self.cost = space, cost

    def find(self, request: Request, num_found: int) -> KVHit | None:
        if not request.swap_block_ids:
            return None
        return KVHit(0)  # a swapped request keeps its computed tokens counted: only their blocks moved

    def fill(self, request: Request, hit: KVHit, block_ids: list[int], plan: SchedulerOutput) -> None:
        plan.swap_in += zip(request.swap_block_ids, block_ids)
        self.space.release(request.swap_block_ids)
        request.swap_block_ids = []

    def swap_out(self, request: Request, block_ids: list[int], num_blocks: int) -> list[tuple[int, int]] | None:
        """(KV block, swap block) copies that take the request's first ``num_blocks`` blocks out, or
        None when recomputing its ``num_computed_tokens`` is cheaper or the swap space is full."""
        if not self.cost.prefers_swap(num_blocks, request.num_computed_tokens):
            return None
        swap_ids = self.space.allocate(num_blocks)
        if swap_ids is None:
            return None
        request.swap_block_ids = swap_ids
        return list(zip(block_ids[:num_blocks], swap_ids))


class TransferSource:
    """KV that a prefill engine computed and sent (decode role): the whole prompt's, written
    into the request's blocks; its first token is already among its outputs."""

    def find(self, request: Request, num_found: int) -> KVHit | None:
        if request.transferred_kv is None:
            return None
        return KVHit(request.num_prompt_tokens)

    def fill(self, request: Request, hit: KVHit, block_ids: list[int], plan: SchedulerOutput) -> None:
        plan.kv_inserts.append((request.request_id, block_ids, request.transferred_kv))
        request.transferred_kv = None
