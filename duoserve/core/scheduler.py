"""Continuous batching under one token budget.

Every request has ``num_computed_tokens`` catching up with ``num_tokens``; a step
gives each a number of new tokens, never more than ``max_num_batched_tokens`` in
all. A decoding request asks for 1, a prompt for the rest of its prompt (cut to the
budget: chunked prefill). Running requests are served first, in admission order;
when blocks run out the newest running request is preempted (its blocks freed, to
be recomputed, mostly from the prefix cache) or, with a swap space and when copying
costs less than recomputing, its KV is copied out to host memory and back in when it is
resumed (swapped requests resume before anything new is admitted). Waiting requests are
admitted FIFO while the budget, ``max_num_seqs`` and free blocks allow.

Roles: a ``colocated`` engine does everything above. A ``prefill`` engine stops a
request at its first token: the request moves to ``KV_LEASED`` (out of the running
set, blocks kept) until the decode side acknowledges its KV or the lease expires. A
``decode`` engine takes requests whose prompt KV arrives from elsewhere: they wait in
``WAITING_FOR_KV`` for blocks, then start decoding with their KV copied in.

Speculative decoding (``duoserve.core.speculation``): a decoding request may compute
guessed tokens after its last one in the same step; it keeps what the target confirms,
and its ``num_computed_tokens`` moves past the accepted guesses only. Guessed tokens never
enter the prefix cache: blocks are published over known tokens alone.

No torch here: this module plans, the model runner computes.
"""

from __future__ import annotations

import time
from collections import deque

from duoserve.core.kv_cache_manager import KVCacheManager
from duoserve.core.outputs import EngineCoreOutput, RunnerOutput, ScheduledRequest, SchedulerOutput
from duoserve.core.request import Request, RequestStatus
from duoserve.core.speculation import SpeculationPolicy
from duoserve.core.swap_space import SwapCost, SwapSpace

S = RequestStatus
PREFILL_AGING_SECONDS = 5.0   # prefill role: a request waiting longer than this goes first


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_batched_tokens: int, max_num_seqs: int,
                 enable_chunked_prefill: bool = True, role: str = "colocated",
                 lease_timeout: float = 30.0, speculation: SpeculationPolicy | None = None,
                 kv_store: object | None = None, swap: SwapSpace | None = None,
                 swap_cost: SwapCost | None = None) -> None:
        self.kv = kv
        self.token_budget = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.children: dict[str, list[str]] = {}   # n > 1: parent id -> ids of its other samples
        self.pending_copies: list[tuple[int, int]] = []
        self.num_preemptions = 0
        self.role = role
        self.lease_timeout = lease_timeout
        self.leases: dict[str, float] = {}              # prefill: leased request id -> deadline
        self.newly_leased: list[tuple[Request, list[int]]] = []  # (request, its blocks) to ship
        self.waiting_for_kv: deque[tuple[Request, object]] = deque()  # decode: (request, KV payload)
        self.speculation = speculation
        # the shared KV tier (duoserve.kv.store.BlockStore): fetch_prefix(request, first_block, block_size)
        self.kv_store = kv_store
        self.pending_loads: list[tuple[int, object]] = []
        self.swap, self.swap_cost = swap, swap_cost
        self.swapped: deque[Request] = deque()
        self.pending_swap_out: list[tuple[int, int]] = []
        self.num_swap_preemptions = 0

    # ---- intake -------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in the engine")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort(self, request_id: str, status: RequestStatus = S.FINISHED_ABORTED,
              error: str | None = None, with_samples: bool = True) -> list[EngineCoreOutput]:
        """Finish a request now (with its other samples unless told not to); returns final outputs."""
        outputs = []
        siblings = self.children.get(request_id, ()) if with_samples else ()
        for rid in [request_id, *siblings]:
            request = self.requests.get(rid)
            if request is None or request.is_finished:
                continue
            request.error = error
            self._finish(request, status)
            outputs.append(EngineCoreOutput(rid, [], finish_reason=status.finish_reason, error=error,
                                            position=request.num_output_tokens))
        return outputs

    @property
    def num_unfinished(self) -> int:
        return (len(self.waiting) + len(self.running) + len(self.waiting_for_kv) + len(self.leases)
                + len(self.swapped))

    # ---- planning -----------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        if self.swap is not None:
            self.swap.end_step()
        budget = self.token_budget
        scheduled: list[ScheduledRequest] = []
        preempted: list[str] = []
        reserved = self._order_shortest_first() if self.role == "prefill" else 0
        budget -= reserved
        speculate = self.speculation is not None and self.speculation.enabled_for_step(len(self.running))
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if num_new <= 0:
                i += 1
                continue
            guesses, num_spec = [], 0
            if speculate and num_new == 1 and request.status is S.RUNNING:
                guesses, num_spec = self.speculation.guesses(request, budget)
            while self.kv.allocate_slots(request, num_new + num_spec) is None:
                if num_spec:  # short of blocks: fewer guesses before anyone is preempted
                    num_spec -= 1
                    del guesses[num_spec:]
                    continue
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is request:
                    break
            else:
                scheduled.append(self._plan(request, num_new, guesses, num_spec))
                budget -= num_new + num_spec
                i += 1
        budget += reserved
        inserts: list[tuple[str, list[int], object]] = []
        swap_in: list[tuple[int, int]] = []
        if not preempted:
            budget = self._resume_swapped(budget, scheduled, swap_in)
            budget = self._admit_transferred(budget, scheduled, inserts)
            budget = self._admit_waiting(budget, scheduled)
        scheduled.sort(key=lambda s: s.num_new_tokens != 1)  # stable: decodes first
        copies, self.pending_copies = self.pending_copies, []
        loads, self.pending_loads = self.pending_loads, []
        swap_out, self.pending_swap_out = self.pending_swap_out, []
        return SchedulerOutput(scheduled, self.token_budget - budget, copies, preempted, inserts, loads,
                               swap_out, swap_in)

    def _resume_swapped(self, budget: int, scheduled: list[ScheduledRequest],
                        swap_in: list[tuple[int, int]]) -> int:
        """Give swapped requests KV blocks again, have their KV copied back, decode on."""
        while self.swapped and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.swapped[0]
            blocks = self.kv.allocate_slots(request, 1)  # its computed tokens and the next one
            if blocks is None:
                break
            self.swapped.popleft()
            swap_in += zip(request.swap_block_ids, [b.block_id for b in blocks])
            self.swap.release(request.swap_block_ids)
            request.swap_block_ids = []
            request.move_to(S.RUNNING)
            self.running.append(request)
            scheduled.append(self._plan(request, 1))
            budget -= 1
        return budget

    def _order_shortest_first(self) -> int:
        """Prefill role: shortest remaining prompt first, so a short prompt never queues behind a
        long one's chunks (there are no decodes here to keep fluid, only first tokens to hurry).

        Sorts the waiting and prefilling requests; returns the budget to hold back from the
        prefilling ones for the waiting prompts shorter than the longest of them, as many as
        fit whole (the prefilling ones always keep at least one token: nothing stalls).

        Aging bounds every wait: a request that arrived more than ``PREFILL_AGING_SECONDS`` ago
        goes before every younger one, oldest first, and nothing is held back from it, so a
        long prompt cannot starve behind a steady stream of short ones.
        """
        now = time.monotonic()

        def remaining(request: Request) -> int:
            return request.num_tokens - request.num_computed_tokens

        def order(request: Request) -> tuple[bool, float]:
            aged = now - request.arrival_time >= PREFILL_AGING_SECONDS
            return (not aged, request.arrival_time if aged else remaining(request))

        if len(self.waiting) > 1:
            self.waiting = deque(sorted(self.waiting, key=order))
        self.running.sort(key=order)
        if not self.waiting or not self.running or not order(self.running[0])[0]:
            return 0
        longest, reserved = remaining(self.running[-1]), 0
        for request in self.waiting:
            need = remaining(request)
            if need >= longest or reserved + need >= self.token_budget:
                break
            reserved += need
        return reserved

    def _admit_transferred(self, budget: int, scheduled: list[ScheduledRequest],
                           inserts: list[tuple[str, list[int], object]]) -> int:
        """Decode role: give arrived requests blocks, have their KV copied in, decode their first token."""
        while self.waiting_for_kv and budget > 0 and len(self.running) < self.max_num_seqs:
            request, payload = self.waiting_for_kv[0]
            if self.kv.allocate_slots(request, request.num_tokens) is None:
                break
            self.waiting_for_kv.popleft()
            inserts.append((request.request_id, self.kv.block_ids(request.request_id), payload))
            request.num_computed_tokens = request.num_prompt_tokens
            request.first_scheduled_time = time.monotonic()
            request.move_to(S.RUNNING)
            self.running.append(request)
            scheduled.append(self._plan(request, request.num_tokens - request.num_computed_tokens))
            budget -= 1
        return budget

    def add_transferred(self, request: Request, payload: object) -> None:
        """Decode role: a request prefilled elsewhere, its first token already in its outputs."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in the engine")
        request.move_to(S.WAITING_FOR_KV)
        self.requests[request.request_id] = request
        self.waiting_for_kv.append((request, payload))

    def acknowledge(self, request_id: str) -> None:
        """Prefill role: the decode side holds the KV now; free the leased blocks."""
        if self.leases.pop(request_id, None) is not None:
            self._finish(self.requests.pop(request_id), S.FINISHED_STOPPED)  # the frontend follows the decode side

    def expire_leases(self, now: float) -> list[EngineCoreOutput]:
        outputs = []
        for request_id, deadline in list(self.leases.items()):
            if now >= deadline:
                error = (f"the decode engine did not acknowledge the KV of request {request_id} within "
                         f"{self.lease_timeout:g} s (--kv-lease-timeout); its blocks were freed")
                outputs += self.abort(request_id, S.FINISHED_ERROR, error, with_samples=False)
        return outputs

    def drain_leased(self) -> list[tuple[Request, list[int]]]:
        leased, self.newly_leased = self.newly_leased, []
        return leased

    def _admit_waiting(self, budget: int, scheduled: list[ScheduledRequest]) -> int:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            has_blocks = request.request_id in self.kv.req_blocks  # a forked sample
            # prompt log-probabilities need every prompt position run through the model:
            # such a request takes no prefix hits (its blocks are still cached for others)
            skip_cache = has_blocks or request.prompt_logprobs is not None
            cached = [] if skip_cache else self.kv.find_cached_prefix(request)
            stored = []  # the blocks after those that the shared KV store holds, loaded
            if self.kv_store is not None and not skip_cache and request.num_computed_tokens == 0:
                stored = self.kv_store.fetch_prefix(request, len(cached), self.kv.block_size)
            num_stored = len(stored) * self.kv.block_size
            num_cached = len(cached) * self.kv.block_size + num_stored
            remaining = request.num_tokens - request.num_computed_tokens - num_cached
            if remaining > budget and not self.enable_chunked_prefill:
                break
            num_new = min(remaining, budget)
            new_blocks = self.kv.allocate_slots(request, num_stored + num_new, cached)
            if new_blocks is None:
                break
            self.pending_loads += [(block.block_id, kv) for block, kv in zip(new_blocks, stored)]
            self.waiting.popleft()
            request.num_computed_tokens += num_cached
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
                request.num_cached_tokens = num_cached
            request.move_to(S.PREFILLING)
            self.running.append(request)
            scheduled.append(self._plan(request, num_new))
            budget -= num_new
        return budget

    def _plan(self, request: Request, num_new: int, guesses: list[int] | None = None,
              num_spec: int = 0) -> ScheduledRequest:
        start = request.num_computed_tokens
        sample = start + num_new == request.num_tokens
        first_token = sample and request.num_output_tokens == 0
        num_samples = request.params.n if first_token and request.sample_index == 0 and \
            request.request_id not in self.children else 1
        wants_prompt_logprobs = request.prompt_logprobs is not None and start < request.num_prompt_tokens
        return ScheduledRequest(request, start, num_new + num_spec, self.kv.block_ids(request.request_id), sample,
                                num_samples, wants_prompt_logprobs, list(guesses or ()), num_spec)

    def _preempt(self, request: Request) -> None:
        """Swap the request's KV out when that is cheaper and there is room, else drop it to be
        recomputed: either way it leaves the running set and its KV blocks are free."""
        if self.swap is not None and request.status is S.RUNNING:
            block_ids = self.kv.block_ids(request.request_id)
            num_blocks = self.kv.num_blocks_for(request.num_computed_tokens)
            if self.swap_cost.prefers_swap(num_blocks, request.num_computed_tokens):
                swap_ids = self.swap.allocate(num_blocks)
                if swap_ids is not None:  # swap full: recompute
                    self.pending_swap_out += zip(block_ids[:num_blocks], swap_ids)
                    self.kv.free(request)
                    request.swap_block_ids = swap_ids
                    request.num_draft_computed = 0   # a draft's KV is not swapped: it catches up
                    request.move_to(S.SWAPPED)
                    self.swapped.append(request)
                    request.num_preemptions += 1
                    self.num_preemptions += 1
                    self.num_swap_preemptions += 1
                    return
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.num_draft_computed = 0
        if request.prompt_logprobs is not None:  # not delivered yet: scored again from the start
            request.prompt_logprobs = []
        request.num_preemptions += 1
        self.num_preemptions += 1
        request.move_to(S.WAITING)
        self.waiting.appendleft(request)

    # ---- results ------------------------------------------------------------------------

    def update(self, plan: SchedulerOutput, result: RunnerOutput) -> list[EngineCoreOutput]:
        outputs: list[EngineCoreOutput] = []
        for item in plan.scheduled:
            request = item.request
            if request.is_finished:
                continue
            num_accepted = 0
            if item.num_spec_tokens:  # the guesses the target confirmed; the rest are recomputed
                num_accepted = len(result.sampled[request.request_id]) - 1
                self.speculation.record(item.num_spec_tokens, num_accepted)
            request.num_computed_tokens += item.num_known_tokens + num_accepted
            request.num_draft_computed = min(request.num_draft_computed, request.num_computed_tokens)
            if item.prompt_logprobs:  # gathered over the chunks, delivered whole with the first token
                request.prompt_logprobs.extend(result.prompt_logprobs.get(request.request_id, ()))
            if not item.sample:
                continue
            prompt_lp = request.take_prompt_logprobs() if item.prompt_logprobs else None
            if request.params.max_tokens == 0:  # prompt only (e.g. for its log-probabilities)
                self._finish(request, S.FINISHED_LENGTH)
                outputs.append(EngineCoreOutput(request.request_id, [], finish_reason="length",
                                                prompt_logprobs=prompt_lp, num_cached_tokens=request.num_cached_tokens))
                continue
            tokens = result.sampled[request.request_id]
            logprobs = result.logprobs.get(request.request_id)
            if item.num_spec_tokens:
                outputs.append(self._append_tokens(request, tokens, logprobs))
                continue
            siblings = [request] + [self._fork(request, k) for k in range(1, item.num_samples)]
            for k, sibling in enumerate(siblings):
                if sibling is None:
                    continue
                out = self._append_tokens(sibling, [tokens[k]], [logprobs[k]] if logprobs else None)
                out.prompt_logprobs = prompt_lp if k == 0 else None
                outputs.append(out)
        return outputs

    def _fork(self, parent: Request, sample_index: int) -> Request | None:
        child = Request(f"{parent.request_id}/{sample_index}", parent.prompt_token_ids, parent.params,
                        parent.eos_token_ids, parent.max_total_tokens, sample_index, parent.arrival_time)
        child.first_scheduled_time = parent.first_scheduled_time
        child.num_cached_tokens = parent.num_cached_tokens
        self.requests[child.request_id] = child
        self.children.setdefault(parent.request_id, []).append(child.request_id)
        copies = self.kv.fork(parent, child)
        child.move_to(S.PREFILLING)
        if copies is None:  # no block for the prompt's tail: recompute this sample later
            child.move_to(S.WAITING)
            self.waiting.append(child)
        else:
            child.num_computed_tokens = parent.num_prompt_tokens
            self.pending_copies.extend(copies)
            self.running.append(child)
        return child

    def _append_tokens(self, request: Request, tokens: list[int], logprobs: list | None) -> EngineCoreOutput:
        """Append tokens up to the first that ends the request (the rest are dropped)."""
        position = request.num_output_tokens
        for token in tokens:
            request.output_token_ids.append(token)
            status, stop_reason = self._check_stop(request, token)
            if status is not None:
                break
        taken = request.num_output_tokens - position
        if status is None:
            if request.status is S.PREFILLING and self.role == "prefill":
                self._lease(request)
            elif request.status is S.PREFILLING:
                request.move_to(S.RUNNING)
        else:
            self._finish(request, status)
        out = EngineCoreOutput(request.request_id, tokens[:taken], position,
                               status.finish_reason if status else None,
                               new_logprobs=logprobs[:taken] if logprobs else None,
                               num_cached_tokens=request.num_cached_tokens, stop_reason=stop_reason)
        if request.num_output_tokens == 1 and request.first_scheduled_time is not None:
            out.stages = {"queue": request.first_scheduled_time - request.arrival_time,
                          "prefill": time.monotonic() - request.first_scheduled_time}
        return out

    def _lease(self, request: Request) -> None:
        request.move_to(S.KV_LEASED)
        self.running.remove(request)
        self.leases[request.request_id] = time.monotonic() + self.lease_timeout
        self.newly_leased.append((request, self.kv.block_ids(request.request_id)))

    def _check_stop(self, request: Request, token: int) -> tuple[RequestStatus | None, int | None]:
        params = request.params
        num_out = request.num_output_tokens
        if num_out >= params.min_tokens:
            if not params.ignore_eos and token in request.eos_token_ids:
                return S.FINISHED_STOPPED, None
            if token in params.stop_token_ids:
                return S.FINISHED_STOPPED, token
        if params.max_tokens is not None and num_out >= params.max_tokens:
            return S.FINISHED_LENGTH, None
        if request.max_total_tokens is not None and request.num_tokens >= request.max_total_tokens:
            return S.FINISHED_LENGTH, None
        return None, None

    def _finish(self, request: Request, status: RequestStatus) -> None:
        if request.status is S.WAITING:
            self.waiting.remove(request)
        elif request.status is S.WAITING_FOR_KV:
            self.waiting_for_kv = deque(item for item in self.waiting_for_kv if item[0] is not request)
        elif request.status is S.KV_LEASED:
            self.leases.pop(request.request_id, None)
        elif request.status is S.SWAPPED:
            self.swapped.remove(request)
            self.swap.release(request.swap_block_ids)
            request.swap_block_ids = []
        elif request in self.running:
            self.running.remove(request)
        request.move_to(status)
        self.kv.free(request)

    def forget(self, request_id: str) -> None:
        """Drop a finished request's record (the frontend has taken its last output)."""
        for rid in [request_id, *self.children.pop(request_id, ())]:
            request = self.requests.get(rid)
            if request is not None and request.is_finished:
                del self.requests[rid]
