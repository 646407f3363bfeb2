"""Continuous batching under one token budget.

Every request has ``num_computed_tokens`` catching up with ``num_tokens``; a step
gives each a number of new tokens, never more than ``max_num_batched_tokens`` in
all (or, paced by time under priority, ``core/step_pacer.py``'s budget: then the running
requests take turns, by rank and the least recently served first). A decoding request asks
for 1, a prompt for the rest of its prompt (cut to the budget: chunked prefill). Running
requests are served first, in admission order; when blocks run out the newest running request
not yet served in the step is preempted (its blocks freed, to
be recomputed, mostly from the prefix cache) or, with a swap space and when copying
costs less than recomputing, its KV is copied out to host memory and back in when it is
resumed (swapped requests resume before anything new is admitted). Waiting requests are
admitted FIFO while the budget, ``max_num_seqs`` and free blocks allow.

Admission asks the KV sources chosen at start (``duoserve.core.kv_sources``) once per request:
the prefix cache and the shared KV store for a prompt, the swap space for a swapped request, a
transfer from a prefill engine for a request waiting for KV. Swapped requests resume first, then
requests whose KV arrived, then new prompts; each queue stops at its first request that does not fit.

Roles (``duoserve.core.roles``, chosen at start): a colocated or decode engine decodes what it
prefilled; a prefill engine serves the shortest prompt first and stops a request at its first
token: it moves to ``KV_LEASED`` (out of the running set, blocks kept) until the decode side
acknowledges its KV or the lease expires. A decode engine takes requests whose prompt KV arrives
from elsewhere: they wait in ``WAITING_FOR_KV`` for blocks, then decode with their KV copied in.

Speculative decoding (``duoserve.core.speculation``): a decoding request may compute
guessed tokens after its last one in the same step; it keeps what the target confirms,
and its ``num_computed_tokens`` moves past the accepted guesses only. Guessed tokens never
enter the prefix cache: blocks are published over known tokens alone.

Structured outputs: a request whose grammar is still compiling (``SchedulerSetup.ready`` says
so) is passed over at admission, the requests behind it still admitted; its matcher lives with
the model runner, which reports the tokens after which a grammar is complete (the request
stops there) and a grammar that broke (the request fails).

Priorities (``SchedulerSetup.policy == "priority"``, ``--scheduling-policy priority``): every queue
and the running set are ordered by each request's ``params.priority`` (lower first; a stable sort,
so arrival or the role's order holds within a priority). When the best waiting request has a
strictly better priority than the worst running one and cannot be admitted (the batch full, or too
few free blocks for its first chunk), running requests of the worst priority are preempted, newest
first, as they are for want of blocks; a step admits from the best priority waiting alone. The
step that computes such a request's prompt leaves out the running requests it outranks (they wait
a step, keeping their KV): its first token comes after its own prompt, not after theirs too.

Fair share (``policy == "fair"``): as priorities, and within a priority by tenant
(``duoserve.core.fair_share``): the queues in the order the virtual token counters pick, the
running set by its tenants' counters, so that a waiting request of a tenant served less preempts
the newest request of the tenant served most when it cannot be admitted. Each step's computed
prompt tokens and sampled tokens are charged to their tenants (a prompt recomputed after a
preemption is not charged again).

Deadlines: a request with ``params.timeout`` that is still waiting for its first step when the
timeout passes is dropped (``expire_deadlines``) with an error starting ``QUEUE_TIMEOUT``, before it
costs a prompt step.

No torch here: this module plans, the model runner computes.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from duoserve.core.fair_share import MARGIN, FairShare
from duoserve.core.kv_cache_manager import KVCacheManager
from duoserve.core.kv_sources import KVHit, KVSource, SwapSource
from duoserve.core.outputs import EngineCoreOutput, RunnerOutput, ScheduledRequest, SchedulerOutput
from duoserve.core.request import Request, RequestStatus
from duoserve.core.roles import RolePolicy
from duoserve.core.speculation import SpeculationPolicy
from duoserve.core.step_pacer import StepPacer

S = RequestStatus
QUEUE_TIMEOUT = "timed out waiting"   # how a dropped request's error starts (the server answers 503)


def _priority(request: Request) -> int:
    return request.params.priority


@dataclass(frozen=True, kw_only=True)
class SchedulerSetup:
    """What a scheduler is built from, chosen at start (``duoserve.engine.builder``)."""
    kv: KVCacheManager
    max_num_batched_tokens: int                    # the token budget of a step
    max_num_seqs: int                              # the most requests in the running set
    enable_chunked_prefill: bool = True            # False: a prompt is admitted whole or waits
    sources: Sequence[KVSource] = ()               # asked in order at admission (kv_sources)
    swap: SwapSource | None = None                 # where preempted KV may go (also one of sources)
    role: RolePolicy = field(default_factory=RolePolicy)
    speculation: SpeculationPolicy | None = None
    ready: Callable[[Request], bool] | None = None   # structured outputs: is its grammar compiled
    policy: str = "fcfs"                           # or "priority", "fair": see Scheduler's docstring
    tenant_weights: Sequence[tuple[str, float]] = ()   # fair: tenants' weights (others 1)
    step_seconds: float | None = None              # a step's target length (core/step_pacer.py); None: by tokens

    def __post_init__(self) -> None:
        if self.swap is not None and not any(source is self.swap for source in self.sources):
            raise ValueError("the swap space must also be one of the sources (its KV comes back at admission)")


class Scheduler:
    def __init__(self, setup: SchedulerSetup) -> None:
        self.kv = setup.kv
        self.token_budget = setup.max_num_batched_tokens
        self.max_num_seqs = setup.max_num_seqs
        self.enable_chunked_prefill = setup.enable_chunked_prefill
        self.sources = tuple(setup.sources)
        self.swap = setup.swap
        self.role = setup.role
        self.speculation = setup.speculation
        self.ready = setup.ready
        self.by_priority = setup.policy in ("priority", "fair")
        self.fair = FairShare(setup.tenant_weights) if setup.policy == "fair" else None
        self.deadlines: list[tuple[float, int, Request]] = []   # a heap: (deadline, order, request)
        self._arrivals = itertools.count()
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.swapped: deque[Request] = deque()
        self.waiting_for_kv: deque[Request] = deque()   # decode role: their KV is in request.transferred_kv
        # the queues admission takes from, in order, and the state each request enters
        self.queues = ((self.swapped, S.RUNNING), (self.waiting_for_kv, S.RUNNING), (self.waiting, S.PREFILLING))
        self.requests: dict[str, Request] = {}
        self.children: dict[str, list[str]] = {}   # n > 1: parent id -> ids of its other samples
        self.pending_copies: list[tuple[int, int]] = []
        self.pending_swap_out: list[tuple[int, int]] = []
        self.num_preemptions = 0
        self.num_swap_preemptions = 0
        self.pacer = StepPacer(setup.step_seconds, self.token_budget) if setup.step_seconds else None
        self.step_budget = self.token_budget   # this step's: the pacer's, else the configured one
        self.num_served = 0   # requests given tokens so far, counted one by one (Request.last_served)

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        """What a step computed and how long the model took (the pacer's measure)."""
        if self.pacer is not None:
            self.pacer.observe(num_tokens, seconds, self.step_budget)

    # ---- intake -------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in the engine")
        self.requests[request.request_id] = request
        self.waiting.append(request)
        if self.fair is not None:
            self.fair.arrive(request)
        if request.params.timeout is not None:
            deadline = request.arrival_time + request.params.timeout
            heapq.heappush(self.deadlines, (deadline, next(self._arrivals), request))

    def add_transferred(self, request: Request, payload: object) -> None:
        """Decode role: a request prefilled elsewhere, its first token already in its outputs."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in the engine")
        request.move_to(S.WAITING_FOR_KV)
        request.transferred_kv = payload
        self.requests[request.request_id] = request
        self.waiting_for_kv.append(request)
        if self.fair is not None:
            self.fair.arrive(request)

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

    def expire_deadlines(self, now: float) -> list[EngineCoreOutput]:
        """Drop the requests whose timeout passed before their first step; their final outputs."""
        outputs = []
        while self.deadlines and self.deadlines[0][0] <= now:
            _, _, request = heapq.heappop(self.deadlines)
            if request.status is S.WAITING and request.first_scheduled_time is None:
                waited = now - request.arrival_time
                outputs += self.abort(request.request_id, S.FINISHED_ERROR,
                                      f"{QUEUE_TIMEOUT} {waited:.2f}s, past its timeout of "
                                      f"{request.params.timeout:g}s: dropped before its prompt was computed")
        return outputs

    @property
    def num_unfinished(self) -> int:
        return (len(self.waiting) + len(self.running) + len(self.waiting_for_kv) + self.role.num_leased
                + len(self.swapped))

    @property
    def has_work(self) -> bool:
        """Requests to compute now (leased KV only waits, it needs no steps)."""
        return bool(self.waiting or self.running or self.waiting_for_kv or self.swapped)

    # ---- leases (prefill role) ------------------------------------------------------------

    @property
    def num_leased(self) -> int:
        return self.role.num_leased

    def acknowledge(self, request_id: str) -> None:
        """The decode side holds the KV now; free the leased blocks."""
        if self.role.release(request_id):
            self._finish(self.requests.pop(request_id), S.FINISHED_STOPPED)  # the frontend follows the decode side

    def expire_leases(self, now: float) -> list[EngineCoreOutput]:
        outputs = []
        for request_id, error in self.role.expired(now):
            outputs += self.abort(request_id, S.FINISHED_ERROR, error, with_samples=False)
        return outputs

    def drain_leased(self) -> list[tuple[Request, list[int]]]:
        return self.role.drain_leased()

    # ---- planning -----------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        if self.swap is not None:
            self.swap.space.end_step()
        step_start = self.num_served
        self.step_budget = budget = self.pacer.budget() if self.pacer is not None else self.token_budget
        plan = SchedulerOutput([], 0)
        scheduled = plan.scheduled
        preempted = plan.preempted_ids
        reserved = self.role.order(self.waiting, self.running, budget)
        made_room = self._make_room_by_priority(plan) if self.by_priority else 0
        first = self._prompt_first() if self.by_priority else None
        budget = self._room_for(first, budget)
        reserved += self._held_for_arrived_kv(reserved)
        budget -= reserved
        speculate = self.speculation is not None and self.speculation.enabled_for_step(len(self.running))
        order = self._in_turn() if self.pacer is not None else list(self.running)
        i = 0
        while i < len(order) and budget > 0:
            request = order[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if request.request_id in preempted or num_new <= 0 or (
                    first is not None and self._outranks(first, request)):
                i += 1
                continue
            guesses, num_spec = [], 0
            if speculate and num_new == 1 and request.status is S.RUNNING:
                guesses, num_spec = self.speculation.guesses(request, budget)
            self.kv.free_outside_window(request)   # before it asks for more: its own frees may serve it
            while self.kv.allocate_slots(request, num_new + num_spec) is None:
                if num_spec:  # short of blocks: fewer guesses before anyone is preempted
                    num_spec -= 1
                    del guesses[num_spec:]
                    continue
                # the newest running request not served yet this step (served ones keep their blocks)
                victim = self.running.pop(next(j for j in range(len(self.running) - 1, -1, -1)
                                               if self.running[j].last_served <= step_start))
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is request:
                    i += 1
                    break
            else:
                scheduled.append(self._plan(request, num_new, guesses, num_spec))
                self.num_served += 1
                request.last_served = self.num_served
                budget -= num_new + num_spec
                i += 1
        budget += reserved
        if len(preempted) == made_room:   # none preempted for want of blocks: admit
            bar = self._best_waiting_rank() if self.by_priority else None
            for queue, status in self.queues:
                budget = self._admit(queue, status, budget, plan, bar)
        scheduled.sort(key=lambda s: s.num_new_tokens != 1)  # stable: decodes first
        plan.num_batched_tokens = self.step_budget - budget
        plan.block_copies, self.pending_copies = self.pending_copies, []
        plan.swap_out, self.pending_swap_out = self.pending_swap_out, []
        return plan

    def _room_for(self, first: Request | None, budget: int) -> int:
        """The step's budget with an outranking prompt in it: the whole prompt (up to the configured
        budget) when the pace would cut it, since the pace is the outranked requests' and a prompt
        cut in two waits a second step for its first token."""
        if first is None or self.pacer is None:
            return budget
        need = min(first.num_tokens - first.num_computed_tokens, self.token_budget)
        if need > budget:
            self.step_budget = budget = need
        return budget

    def _in_turn(self) -> list[Request]:
        """The running requests in the order a paced step serves them when it cannot serve all:
        by rank, then the least recently served first (each gets its turn)."""
        return sorted(self.running, key=lambda r: (self._rank(r), r.last_served))

    # ---- priorities (--scheduling-policy priority) ------------------------------------------

    def _rank(self, request: Request) -> tuple[int, float]:
        """Lower goes first: the priority, then (fair) the tenant's counter."""
        return _priority(request), self.fair.counter(request.params.tenant) if self.fair is not None else 0.0

    def _outranks(self, waiting: Request, running: Request) -> bool:
        """Whether ``waiting`` may preempt ``running``: a better priority, or (fair) the same one and
        a tenant served enough less (``FairShare.outranks``)."""
        if _priority(waiting) != _priority(running):
            return _priority(waiting) < _priority(running)
        return self.fair is not None and self.fair.outranks(waiting, running)

    def _order_by_priority(self) -> None:
        """Every queue and the running set by priority, lower first; a stable sort, so that the
        role's order (arrival, or a prefill engine's shortest first) holds within a priority.
        Fair: within a priority, the queues in the order fair share picks, the running set by
        its tenants' counters (the most served last: preempted first)."""
        for queue, _ in self.queues:
            if len(queue) > 1:
                ordered = sorted(queue, key=_priority)
                if self.fair is not None:
                    ordered = self._fair_order(ordered)
                queue.clear()
                queue.extend(ordered)
        self.running.sort(key=self._rank)

    def _fair_order(self, ordered: list[Request]) -> list[Request]:
        """Each run of one priority in ``ordered`` reordered by fair share."""
        out, start = [], 0
        for end in range(1, len(ordered) + 1):
            if end == len(ordered) or _priority(ordered[end]) != _priority(ordered[start]):
                out += self.fair.order(ordered[start:end])
                start = end
        return out

    def _make_room_by_priority(self, plan: SchedulerOutput) -> int:
        """Preempt the running requests of the worst rank (priority, then fair share), newest first,
        while the best waiting request outranks them and could not be admitted: the batch full, or
        too few free blocks for its first chunk. Each goes back to wait (swapped or to be recomputed) and
        resumes with the tokens it would have produced. Returns how many were preempted."""
        self._order_by_priority()
        made = 0
        while self.waiting and self.running and self._outranks(self.waiting[0], self.running[-1]):
            best = self.waiting[0]
            first_chunk = min(best.num_tokens - best.num_computed_tokens, self.step_budget)
            if (len(self.running) < self.max_num_seqs
                    and self.kv.pool.num_free_blocks >= self.kv.num_blocks_for(first_chunk)):
                break
            victim = self.running.pop()
            self._preempt(victim)
            plan.preempted_ids.append(victim.request_id)
            made += 1
            self._order_by_priority()   # the victim waits at the head of its own priority
        return made

    def _prompt_first(self) -> Request | None:
        """The best waiting prompt, when it outranks running requests and can be admitted now:
        the requests it outranks wait this step, which computes its prompt (beside its own class's
        requests) so that its first token comes a step's worth of the others' tokens sooner."""
        if not self.waiting or not self.running:
            return None
        best = self.waiting[0]
        if best.num_output_tokens or not self._outranks(best, self.running[-1]):
            return None
        if self.ready is not None and not self.ready(best):
            return None
        first_chunk = min(best.num_tokens - best.num_computed_tokens, self.step_budget)
        if (len(self.running) >= self.max_num_seqs
                or self.kv.pool.num_free_blocks < self.kv.num_blocks_for(first_chunk)):
            return None
        return best

    def _best_waiting_rank(self) -> tuple[int, float] | None:
        """The best rank among the queues' heads: this step admits that priority alone (the next
        step the next one), so a resumed or arrived request of a worse priority never takes the
        place of a better one; under fair share, within it, none of a tenant served ``MARGIN``
        more than the best waiting one's, so that the step computing that tenant's prompt is no
        longer for the others' (its first token comes sooner)."""
        heads = [self._rank(queue[0]) for queue, _ in self.queues if queue]
        return min(heads) if heads else None

    def _behind(self, request: Request, bar: tuple[int, float]) -> bool:
        priority, counter = self._rank(request)
        if priority != bar[0]:
            return priority > bar[0]
        return self.fair is not None and counter > bar[1] + MARGIN

    def _held_for_arrived_kv(self, reserved: int) -> int:
        """A token of the budget for each request whose KV has arrived (``WAITING_FOR_KV``), taken
        from a prompt's chunk, never from a running decode: else a prompt computed here in chunks
        takes every step's budget, and requests whose first token the client already has wait for
        all of it before their second."""
        if not self.waiting_for_kv:
            return 0
        decodes = sum(1 for r in self.running if r.num_tokens - r.num_computed_tokens == 1)
        return min(len(self.waiting_for_kv), max(self.step_budget - reserved - decodes, 0))

    def _find_kv(self, request: Request) -> tuple[list[tuple[KVSource, KVHit]], int]:
        """Every source's hit for ``request``, in order, and the tokens they provide together."""
        hits, num_found = [], 0
        for source in self.sources:
            hit = source.find(request, num_found)
            if hit is not None:
                hits.append((source, hit))
                num_found += hit.num_tokens
        return hits, num_found

    def _admit(self, queue: deque[Request], status: RequestStatus, budget: int, plan: SchedulerOutput,
               bar: tuple[int, float] | None = None) -> int:
        """Move requests from ``queue`` into the running set (as ``status``) while the budget,
        ``max_num_seqs`` and free blocks allow: their KV from the sources, the rest computed.
        A request whose grammar is not compiled yet keeps its place; the ones behind it go on.
        ``bar``: the best waiting rank, behind which none is admitted (None: any)."""
        passed_over: list[Request] = []
        while queue and budget > 0 and len(self.running) < self.max_num_seqs:
            request = queue[0]
            if bar is not None and self._behind(request, bar):
                break
            if self.ready is not None and not self.ready(request):
                passed_over.append(queue.popleft())
                continue
            hits, num_found = self._find_kv(request)
            shared = hits[0][1].shared_blocks if hits else []
            remaining = request.num_tokens - request.num_computed_tokens - num_found
            if remaining > budget and not self.enable_chunked_prefill:
                break
            num_new = min(remaining, budget)
            new_blocks = self.kv.allocate_slots(request, num_found - len(shared) * self.kv.block_size + num_new,
                                                shared)
            if new_blocks is None:
                break
            queue.popleft()
            self._fill(request, hits, new_blocks, plan)
            request.num_computed_tokens += num_found
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
                # += : a transferred request arrives with the prefill engine's count
                request.num_cached_tokens += sum(hit.num_tokens for _, hit in hits if hit.cached)
            request.move_to(status)
            self.running.append(request)
            plan.scheduled.append(self._plan(request, num_new))
            budget -= num_new
        queue.extendleft(reversed(passed_over))
        return budget

    def _fill(self, request: Request, hits: list[tuple[KVSource, KVHit]], new_blocks: list,
              plan: SchedulerOutput) -> None:
        """Have each hit's KV copied into the new blocks it fills (shared blocks need nothing)."""
        if not hits:
            return
        block_ids = [block.block_id for block in new_blocks]
        first = 0
        for source, hit in hits:
            source.fill(request, hit, block_ids[first:], plan)
            if not hit.shared_blocks:
                first += hit.num_tokens // self.kv.block_size

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
        # one whose window freed blocks is recomputed (freeing as it goes): its table lacks KV to swap
        if self.swap is not None and request.status is S.RUNNING and not self.kv.has_window_freed(request):
            num_blocks = self.kv.num_blocks_for(request.num_computed_tokens)
            copies = self.swap.swap_out(request, self.kv.block_ids(request.request_id), num_blocks)
            if copies is not None:
                self.pending_swap_out += copies
                self.kv.free(request)
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
            if self.fair is not None:
                self._charge_prompt(item)
            request.num_computed_tokens += item.num_known_tokens + num_accepted
            request.num_draft_computed = min(request.num_draft_computed, request.num_computed_tokens)
            if item.prompt_logprobs:  # gathered over the chunks, delivered whole with the first token
                request.prompt_logprobs.extend(result.prompt_logprobs.get(request.request_id, ()))
            if not item.sample:
                continue
            prompt_lp = request.take_prompt_logprobs() if item.prompt_logprobs else None
            if request.request_id in result.failed:
                outputs += self.abort(request.request_id, S.FINISHED_ERROR, result.failed[request.request_id],
                                      with_samples=False)
                continue
            if request.params.max_tokens == 0:  # prompt only (e.g. for its log-probabilities)
                self._finish(request, S.FINISHED_LENGTH)
                outputs.append(EngineCoreOutput(request.request_id, [], finish_reason="length",
                                                prompt_logprobs=prompt_lp, num_cached_tokens=request.num_cached_tokens,
                                                pooled=result.pooled.get(request.request_id)))
                continue
            tokens = result.sampled[request.request_id]
            logprobs = result.logprobs.get(request.request_id)
            ended = result.grammar_ended.get(request.request_id)
            if item.num_spec_tokens:
                outputs.append(self._append_tokens(request, tokens, logprobs, ended))
                continue
            siblings = [(request, True)] + [self._fork(request, k) for k in range(1, item.num_samples)]
            for k, (sibling, placed) in enumerate(siblings):
                out = self._append_tokens(sibling, [tokens[k]], [logprobs[k]] if logprobs else None,
                                          ended[k:k + 1] if ended else None)
                out.prompt_logprobs = prompt_lp if k == 0 else None
                outputs.append(out)
                if not placed and not out.finished:   # no block for its prompt's tail: recompute it later
                    sibling.move_to(S.WAITING)
                    self.waiting.append(sibling)
        return outputs

    def _charge_prompt(self, item: ScheduledRequest) -> None:
        """Fair share: the prompt tokens this step computed for the first time, to their tenant."""
        request = item.request
        end = min(item.start + item.num_known_tokens, request.num_prompt_tokens)
        new = end - max(item.start, request.num_charged_prompt_tokens)
        if new > 0:
            self.fair.charge(request, new, 0)
            request.num_charged_prompt_tokens = end

    def _fork(self, parent: Request, sample_index: int) -> tuple[Request, bool]:
        """Sample ``sample_index`` of ``parent`` after its prompt: sharing the prompt's blocks
        (True), or without a block for the prompt's tail (False: it waits, unless its first
        token ends it)."""
        child = Request(f"{parent.request_id}/{sample_index}", parent.prompt_token_ids, parent.params,
                        parent.eos_token_ids, parent.max_total_tokens, sample_index, parent.arrival_time)
        child.first_scheduled_time = parent.first_scheduled_time
        child.num_cached_tokens = parent.num_cached_tokens
        self.requests[child.request_id] = child
        self.children.setdefault(parent.request_id, []).append(child.request_id)
        if self.fair is not None:
            self.fair.arrive(child)
        copies = self.kv.fork(parent, child)
        child.move_to(S.PREFILLING)
        if copies is None:
            return child, False
        child.num_computed_tokens = parent.num_prompt_tokens
        self.pending_copies.extend(copies)
        self.running.append(child)
        return child, True

    def _append_tokens(self, request: Request, tokens: list[int], logprobs: list | None,
                       grammar_ended: list[bool] | None = None) -> EngineCoreOutput:
        """Append tokens up to the first that ends the request (the rest are dropped); with a
        grammar, ``grammar_ended`` says after which tokens it is complete."""
        position = request.num_output_tokens
        for i, token in enumerate(tokens):
            request.output_token_ids.append(token)
            status, stop_reason = self._check_stop(request, token)
            if status is None and grammar_ended and grammar_ended[i]:
                status = S.FINISHED_STOPPED
            if status is not None:
                break
        taken = request.num_output_tokens - position
        if self.fair is not None:
            self.fair.charge(request, 0, taken)
        if status is None:
            if request.status is S.PREFILLING and self.role.after_prefill(request):
                self.running.remove(request)   # leased: its KV waits for the decode engine
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
            self.waiting_for_kv.remove(request)
            request.transferred_kv = None
        elif request.status is S.KV_LEASED:
            self.role.release(request.request_id)
        elif request.status is S.SWAPPED:
            self.swapped.remove(request)
            self.swap.space.release(request.swap_block_ids)
            request.swap_block_ids = []
        elif request in self.running:
            self.running.remove(request)
        request.move_to(status)
        self.kv.free(request)
        if self.fair is not None:
            self.fair.leave(request)

    def forget(self, request_id: str) -> None:
        """Drop a finished request's record (the frontend has taken its last output)."""
        for rid in [request_id, *self.children.pop(request_id, ())]:
            request = self.requests.get(rid)
            if request is not None and request.is_finished:
                del self.requests[rid]
