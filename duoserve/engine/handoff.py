"""What an engine does with KV across engines, one component per role chosen at start.

- colocated: ``Handoff``, which does nothing.
- prefill: ``SendKV``. The scheduler leases a request at its first token
  (``duoserve.core.roles.PrefillOnly``); after the step its prompt's KV is read out of the
  cache and sent with the request to the decode engine the frontend named. Before each step
  the decode engines' acks free their leases and leases past ``--kv-lease-timeout`` fail.
- decode: ``ReceiveKV``. Before each step arrived transfers become requests waiting for
  blocks (``Scheduler.add_transferred``); the step that writes their KV (``TransferSource``)
  acks them to the sender and restates the prefill engine's first token.

A connector (``duoserve.kv.connector``) carries the transfers; it is attached after the
engine is built, by the process that knows the sockets. A failed transfer fails its own
request, never the engine.
"""

from __future__ import annotations

import collections
import logging
import time

from duoserve.core.outputs import EngineCoreOutput, SchedulerOutput
from duoserve.core.rates import moving_average
from duoserve.core.request import RequestStatus
from duoserve.core.scheduler import Scheduler
from duoserve.kv.connector import KVReceiver, KVSender, KVTransfer
from duoserve.kv.reblock import extract_kv
from duoserve.kv.staging import to_host
from duoserve.messages import TransferMeta
from duoserve.worker.lora import adapter_problem
from duoserve.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class Handoff:
    """A colocated engine's: no other engine, nothing to hand over."""

    def __init__(self) -> None:
        self.connector: KVSender | KVReceiver | None = None   # attached once the role's peers are known
        self.num_transfer_bytes = 0   # cumulative bytes of KV sent
        self.seconds_per_token = 0.0  # prefill role: reading and sending KV, per prompt token (average)

    def before_step(self) -> list[EngineCoreOutput]:
        """Take the other side's messages; returns the outputs they finish."""
        return []

    def after_step(self, plan: SchedulerOutput, outputs: list[EngineCoreOutput]) -> None:
        """Hand over what the step prepared; may add to ``outputs``."""

    def route(self, request_id: str, peer: str | None, peer_instance: str | None) -> None:
        """Where a new request's KV goes (the frontend's choice of decode engine)."""

    def ended_early(self, request_id: str, whole: bool) -> None:
        """A request unknown here was aborted or released (``whole``), or one sample of it stopped."""

    def forget(self, request_id: str) -> None:
        """The frontend has taken a request's last output."""

    def drain_transfer_seconds(self) -> list[float]:
        return []


class SendKV(Handoff):
    """A prefill engine's: ships each leased request with its prompt's KV, frees acked leases."""

    def __init__(self, scheduler: Scheduler, runner: ModelRunner, lease_timeout: float) -> None:
        super().__init__()
        self.scheduler, self.runner, self.lease_timeout = scheduler, runner, lease_timeout
        # between processes: request id -> (decode engine, its instance id) for the KV
        self.destinations: dict[str, tuple[str | None, str | None]] = {}
        self.recent_transfer_seconds: list[float] = []

    def before_step(self) -> list[EngineCoreOutput]:
        if self.connector is None:
            return []
        for request_id in self.connector.poll_acks():
            self.scheduler.acknowledge(request_id)
        outputs = self.scheduler.expire_leases(time.monotonic())
        self.connector.sweep(self.lease_timeout)
        return outputs

    def route(self, request_id: str, peer: str | None, peer_instance: str | None) -> None:
        if peer is not None:
            self.destinations[request_id] = (peer, peer_instance)

    def forget(self, request_id: str) -> None:
        self.destinations.pop(request_id, None)

    def after_step(self, plan: SchedulerOutput, outputs: list[EngineCoreOutput]) -> None:
        """Send each request that just got its first token, with its prompt's KV."""
        leased = self.scheduler.drain_leased()
        if not leased:
            return
        start = time.perf_counter()
        if self.scheduler.pending_copies:  # a forked sample's tail block must be in place first
            self.runner.copy_blocks(self.scheduler.pending_copies)
        first_logprobs = {o.request_id: o.new_logprobs[0] for o in outputs if o.new_logprobs}
        prompt_logprobs = {o.request_id: o.prompt_logprobs for o in outputs if o.prompt_logprobs is not None}
        stages = {o.request_id: o.stages for o in outputs if o.stages}
        for request, block_ids in leased:
            keys, values = extract_kv(self.runner.kv_caches, block_ids, request.num_prompt_tokens)
            host = to_host([*keys, *values])   # from a GPU: through pinned memory, one sync
            keys, values = host[:len(keys)], host[len(keys):]
            peer, instance = self.destinations.get(request.request_id.partition("/")[0], (None, None))
            meta = TransferMeta.from_request(
                request, first_token=request.output_token_ids[0], instance_id=instance or "",
                first_logprobs=first_logprobs.get(request.request_id),
                prompt_logprobs=prompt_logprobs.get(request.request_id), sent_at=time.monotonic(),
                stages=stages.get(request.request_id, {}), num_cached_tokens=request.num_cached_tokens)
            transfer = KVTransfer(meta, keys, values, peer=peer)
            try:
                self.connector.send(transfer)
            except Exception as exc:  # e.g. no such decode engine: this request fails, the engine serves on
                logger.error("cannot send the KV of request %s: %s", request.request_id, exc)
                outputs += self.scheduler.abort(request.request_id, RequestStatus.FINISHED_ERROR,
                                                f"the KV handoff failed: {exc}", with_samples=False)
                continue
            self.num_transfer_bytes += transfer.num_bytes
            self.recent_transfer_seconds.append(self.connector.last_transfer[1])
        num_tokens = sum(request.num_prompt_tokens for request, _ in leased)
        self.seconds_per_token = moving_average(self.seconds_per_token, (time.perf_counter() - start) / num_tokens)

    def drain_transfer_seconds(self) -> list[float]:
        seconds, self.recent_transfer_seconds = self.recent_transfer_seconds, []
        return seconds


class ReceiveKV(Handoff):
    """A decode engine's: arrived transfers wait for blocks; once their KV is in, acks and the
    prefill engine's first token restated."""

    def __init__(self, scheduler: Scheduler, runner: ModelRunner | None = None) -> None:
        super().__init__()
        self.scheduler, self.runner = scheduler, runner
        # requests ended before their KV arrived (the frontend's message overtook the transfer):
        # whole requests (aborted or released), and single samples stopped by a stop string
        self.aborted_early: collections.deque[str] = collections.deque(maxlen=4096)
        self.stopped_early: collections.deque[str] = collections.deque(maxlen=4096)

    def ended_early(self, request_id: str, whole: bool) -> None:
        (self.aborted_early if whole else self.stopped_early).append(request_id)

    def before_step(self) -> list[EngineCoreOutput]:
        if self.connector is None:
            return []
        refused: list[EngineCoreOutput] = []
        for transfer in self.connector.poll_transfers():
            request_id = transfer.request_id
            if request_id.partition("/")[0] in self.aborted_early or request_id in self.stopped_early:
                self.connector.acknowledge(request_id)   # free the sender's lease, compute nothing
                continue
            request = transfer.meta.to_request()
            problem = adapter_problem(self.runner.lora if self.runner else None, request.params.lora_name,
                                      request.params.lora_digest)
            if problem is not None:   # KV computed by another adapter than ours: never decoded on
                logger.error("refused a transferred request: %s", problem)
                self.connector.acknowledge(request_id)
                refused.append(EngineCoreOutput(request_id, [], finish_reason="error", error=problem))
                continue
            request.output_token_ids.append(transfer.meta.first_token)
            request.prompt_logprobs = None   # the prefill engine delivered them
            request.num_cached_tokens = transfer.meta.num_cached_tokens   # what the client's usage reports
            try:
                self.scheduler.add_transferred(request, transfer)
            except ValueError as exc:  # e.g. a duplicate id: refuse this one, keep serving
                logger.error("refused a transferred request: %s", exc)
                self.connector.acknowledge(request_id)
        return refused

    def after_step(self, plan: SchedulerOutput, outputs: list[EngineCoreOutput]) -> None:
        """Ack each arrived KV, and report the prefill engine's first token again.

        The two engines' outputs reach the frontend by different routes, so the decode
        side's first output restates the first token (position 0) and the prefill engine's
        TTFT stages: the frontend keeps whichever copy comes first and drops the other.
        """
        if not plan.kv_inserts:
            return
        by_id = {o.request_id: o for o in outputs}
        for request_id, _, transfer in plan.kv_inserts:
            self.connector.acknowledge(request_id)
            out = by_id.get(request_id)
            request = self.scheduler.requests.get(request_id)
            if out is None or request is None or not out.new_token_ids:
                continue
            meta = transfer.meta
            out.new_token_ids = [request.output_token_ids[0], *out.new_token_ids]
            out.position = 0
            if out.new_logprobs is not None and meta.first_logprobs is not None:
                out.new_logprobs = [meta.first_logprobs, *out.new_logprobs]
            out.prompt_logprobs = meta.prompt_logprobs
            received = transfer.received_at or request.first_scheduled_time
            out.stages = {**meta.stages, "transfer": max(received - meta.sent_at, 0.0),
                          "admit": max(request.first_scheduled_time - received, 0.0)}
