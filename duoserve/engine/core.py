"""EngineCore: one engine's loop, ``step() = schedule -> execute -> update``.

It owns a scheduler (pure bookkeeping) and a model runner (tensors). Requests
come in already tokenized; outputs leave as token deltas. The frontend, in this
process or another, turns them into text.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import gc
import logging
import os
import time

import torch

from duoserve.config import EngineConfig
from duoserve.errors import ConfigError
from duoserve.core.kv_cache_manager import KVCacheManager
from duoserve.core.outputs import EngineCoreOutput
from duoserve.core.request import Request, RequestStatus
from duoserve.core.scheduler import Scheduler
from duoserve.core.speculation import SpeculationPolicy
from duoserve.core.swap_space import SwapCost, SwapSpace
from duoserve.messages import EngineStats
from duoserve.kv.connector import KVTransfer
from duoserve.kv.reblock import extract_kv
from duoserve.kv.staging import to_host
from duoserve.model.loader import LoadedModel, check_max_model_len, load_model, weight_bytes
from duoserve.platform import resolve_device
from duoserve.worker.kv_cache import bytes_per_token, num_kv_blocks
from duoserve.worker.memory import measure_prefill_scratch, rss_bytes, tensor_resident_bytes
from duoserve.worker.draft import DraftRunner, load_draft
from duoserve.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        start = time.monotonic()
        runtime_bytes = rss_bytes() if loaded is None else None  # the process before the model
        self.device = resolve_device(config.model)
        self.loaded = loaded or load_model(dataclasses.replace(config.model, device=self.device))
        self.arch = self.loaded.arch
        self.tokenizer = self.loaded.tokenizer
        self.max_model_len = check_max_model_len(self.arch, config.model.max_model_len)
        budget = config.scheduler.token_budget(self.max_model_len)
        cache = config.cache
        kv_dtype = self.loaded.dtype if cache.kv_cache_dtype == "auto" else getattr(torch, cache.kv_cache_dtype)
        spec = config.speculative if config.role != "prefill" else None  # a prefill engine never decodes
        self.draft = None  # speculative decoding's draft model
        if spec is not None and spec.method == "draft":
            self.draft = load_draft(spec, config.model, self.loaded, self.max_model_len)
        self.num_blocks = num_kv_blocks(self.arch, cache, kv_dtype, self.device, self.max_model_len,
                                        self.draft.arch if self.draft else None)
        self.kv = KVCacheManager(self.num_blocks, cache.block_size, cache.enable_prefix_caching)
        self.speculation = SpeculationPolicy(spec) if spec else None
        self.kv_store = self._open_kv_store(kv_dtype) if config.kv_store is not None else None
        block_bytes = bytes_per_token(self.arch, kv_dtype) * cache.block_size
        self.num_swap_blocks = int(cache.swap_space * (1 << 30)) // block_bytes
        self.swap = SwapSpace(self.num_swap_blocks) if self.num_swap_blocks else None
        self.swap_cost = SwapCost(block_bytes)
        self.scheduler = Scheduler(self.kv, budget, config.scheduler.max_num_seqs,
                                   config.scheduler.enable_chunked_prefill, config.role, config.kv_lease_timeout,
                                   self.speculation, self.kv_store, self.swap, self.swap_cost)
        self.connector = None  # prefill/decode roles: the KV connector to the other side (attach_connector)
        # decode role: requests ended before their KV arrived (the frontend's message overtook the
        # transfer): whole requests (aborted or released), and single samples stopped by a stop string
        self.aborted_early: collections.deque[str] = collections.deque(maxlen=4096)
        self.stopped_early: collections.deque[str] = collections.deque(maxlen=4096)
        # prefill role between processes: request id -> (decode engine, its instance id) for the KV
        self.kv_destinations: dict[str, tuple[str | None, str | None]] = {}
        self.num_kv_transfer_bytes = 0
        self.recent_transfer_seconds: list[float] = []
        compile_model = not config.enforce_eager and self.device == "cpu"
        self.runner = ModelRunner(self.loaded, self.num_blocks, cache.block_size, kv_dtype,
                                  self.device, config.model.seed, compile_model=compile_model)
        weights = weight_bytes(self.loaded.model)   # by kind, once: loading and the report both need it
        loading_bytes = self._loading_bytes(runtime_bytes, sum(weights.values()))
        if self.swap is not None:
            self.runner.allocate_swap(self.num_swap_blocks, cache.block_size, kv_dtype)
        if self.draft is not None:
            self.runner.drafter = DraftRunner(self.draft, self.num_blocks, cache.block_size, kv_dtype, self.device,
                                              config.model.seed, compile_model, max_catch_up=budget)
        self.num_generated_tokens = 0
        self.num_prompt_tokens = 0
        # The model, its compiled graph and the tokenizer are millions of long-lived objects: moved
        # out of the garbage collector's sight, a collection during a step scans only new ones.
        self.memory = self._memory_report(runtime_bytes, loading_bytes, weights, kv_dtype, block_bytes, budget)
        gc.collect()
        gc.freeze()
        logger.info("engine ready in %.1fs: %s, %d KV blocks of %d tokens, budget %d tokens/step",
                    time.monotonic() - start, self.loaded.path.name, self.num_blocks, cache.block_size, budget)

    def _loading_bytes(self, runtime_bytes: int | None, weights: int) -> int | None:
        """What loading the model and building its runner left resident beyond the weights and
        the KV pages: the tokenizer, the loader's leftovers, compiled code (before any request)."""
        if runtime_bytes is None or self.device != "cpu":
            return None
        kv_pages = tensor_resident_bytes(self.runner.kv_caches[0][0])  # one buffer holds every layer's
        return rss_bytes() - runtime_bytes - weights - kv_pages

    def _memory_report(self, runtime_bytes: int | None, loading_bytes: int | None, weights: dict[str, int],
                       kv_dtype: torch.dtype, per_block: int, budget: int) -> dict:
        """Where this engine's memory goes (``duoserve.worker.memory``), logged once at start;
        served at ``/v1/memory`` and as ``duoserve:memory_bytes``."""
        cache = self.config.cache
        kv_buffer = self.runner.kv_caches[0][0]
        scratch = None
        if self.device == "cpu":
            scratch = measure_prefill_scratch(lambda: self.runner.scratch_forward(min(budget, self.max_model_len)),
                                              kv_buffer)
        report = {
            "weights_bytes": {kind: size for kind, size in weights.items() if size},
            "kv_pool": {"blocks": self.num_blocks, "block_size": cache.block_size,
                        "tokens": self.num_blocks * cache.block_size, "dtype": str(kv_dtype).removeprefix("torch."),
                        "bytes": self.num_blocks * per_block,
                        "resident_bytes": tensor_resident_bytes(kv_buffer) if self.device == "cpu" else None},
            "swap": {"blocks": self.num_swap_blocks, "bytes": self.num_swap_blocks * per_block},
            "prefill_scratch_bytes": scratch, "prefill_scratch_tokens": min(budget, self.max_model_len),
            "runtime_bytes": runtime_bytes, "loading_bytes": loading_bytes,
            "rss_bytes": rss_bytes() if self.device == "cpu" else None,
            "pid": os.getpid(),   # which process this is (operators, the chaos tests)
        }
        if self.draft is not None:
            report["draft_weights_bytes"] = sum(weight_bytes(self.draft.model).values())
        mb = 2 ** 20
        logger.info("memory: weights %.0f MB, KV pool %.0f MB reserved (%d tokens of %s), swap %.0f MB, "
                    "prefill scratch %s MB (%d tokens), runtime %s MB, loading %s MB, resident %s MB",
                    sum(report["weights_bytes"].values()) / mb, report["kv_pool"]["bytes"] / mb,
                    report["kv_pool"]["tokens"], report["kv_pool"]["dtype"], report["swap"]["bytes"] / mb,
                    "?" if scratch is None else f"{scratch / mb:.0f}", report["prefill_scratch_tokens"],
                    "?" if runtime_bytes is None else f"{runtime_bytes / mb:.0f}",
                    "?" if loading_bytes is None else f"{loading_bytes / mb:.0f}",
                    "?" if report["rss_bytes"] is None else f"{report['rss_bytes'] / mb:.0f}")
        return report

    def _open_kv_store(self, kv_dtype: torch.dtype):
        """The shared KV tier, keyed by this model's fingerprint and KV layout; it extends the prefix
        cache, whose block hashes it uses."""
        from duoserve.kv.store import BlockStore
        from duoserve.model.fingerprint import fingerprint

        if not self.config.cache.enable_prefix_caching:
            raise ConfigError("enable_prefix_caching", False, "on with --kv-store (the store keeps the prefix "
                              "cache's blocks)")
        digest = fingerprint(self.fingerprint_values)
        layout = {"dtype": str(kv_dtype), "block_size": self.config.cache.block_size,
                  "num_layers": self.arch.num_layers, "num_kv_heads": self.arch.num_kv_heads,
                  "head_dim": self.arch.head_dim}
        self.kv.record_published = True
        return BlockStore(self.config.kv_store, digest, layout)

    def _store_published(self) -> None:
        """Queue the blocks published this step (their KV is computed now) for the shared KV store."""
        published = self.kv.drain_published()
        if not published:
            return
        if self.kv_store.breaker.is_open:  # the store is away: not worth reading the blocks out
            self.kv_store.drop(len(published))
            return
        block_ids = [block_id for block_id, _, _ in published]
        keys, values = extract_kv(self.runner.kv_caches, block_ids, len(block_ids) * self.config.cache.block_size)
        keys, values = to_host(keys), to_host(values)
        size = self.config.cache.block_size
        for i, (_, block_hash, token_ids) in enumerate(published):
            rows = slice(i * size, (i + 1) * size)
            self.kv_store.submit(block_hash, token_ids, [k[rows] for k in keys], [v[rows] for v in values])

    def close(self) -> None:
        if self.kv_store is not None:
            self.kv_store.close()

    @functools.cached_property
    def fingerprint_values(self) -> dict:
        """What this engine's model fingerprint covers (``describe``), computed once: the KV store's
        keys and the handshake between prefill and decode engines both start from it."""
        from duoserve.model.fingerprint import describe

        return describe(self.arch, self.tokenizer, self.loaded.path, self.loaded.quantization)

    @property
    def vocab_size(self) -> int:
        return self.arch.vocab_size

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        if self.tokenizer is not None and self.tokenizer.eos_token_ids:
            return self.tokenizer.eos_token_ids
        return self.arch.eos_token_ids

    def add_request(self, request: Request, kv_peer: str | None = None, kv_peer_instance: str | None = None) -> None:
        self.scheduler.add_request(request)
        if kv_peer is not None:
            self.kv_destinations[request.request_id] = (kv_peer, kv_peer_instance)

    def abort(self, request_id: str) -> list[EngineCoreOutput]:
        """Abort a request and all its samples."""
        if request_id not in self.scheduler.requests:
            self.aborted_early.append(request_id)
        return self.scheduler.abort(request_id)

    def finish_stopped(self, request_id: str) -> None:
        """One sample ended on a stop string (found by the frontend's detokenizer)."""
        if request_id not in self.scheduler.requests:
            self.stopped_early.append(request_id)
        self.scheduler.abort(request_id, RequestStatus.FINISHED_STOPPED, with_samples=False)

    def release(self, request_id: str) -> None:
        """The frontend has taken a finished request's last output: forget it."""
        if request_id not in self.scheduler.requests:
            self.aborted_early.append(request_id)
        self.scheduler.forget(request_id)
        self.kv_destinations.pop(request_id, None)

    def reset(self, prefix: str = "") -> int:
        """Abort and forget every request whose id starts with ``prefix`` (their frontend is
        gone; "" = all); returns how many requests (not samples) there were."""
        request_ids = [rid for rid in self.scheduler.requests if rid.startswith(prefix)]
        parents = {rid.partition("/")[0] for rid in request_ids}
        for request_id in request_ids:
            self.abort(request_id)
        for parent in parents:
            self.release(parent)
        return len(parents)

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def has_work(self) -> bool:
        """Requests to compute now (leased KV only waits, it needs no steps)."""
        s = self.scheduler
        return bool(s.waiting or s.running or s.waiting_for_kv or s.swapped)

    def attach_connector(self, connector) -> None:
        self.connector = connector

    def _exchange_kv(self) -> list[EngineCoreOutput]:
        """Take the other side's messages: acks (prefill role) or arrived transfers (decode role)."""
        outputs: list[EngineCoreOutput] = []
        if self.connector is None:
            return outputs
        if self.config.role == "prefill":
            for request_id in self.connector.poll_acks():
                self.scheduler.acknowledge(request_id)
            outputs += self.scheduler.expire_leases(time.monotonic())
            self.connector.sweep(self.config.kv_lease_timeout)
        elif self.config.role == "decode":
            for transfer in self.connector.poll_transfers():
                ended = (transfer.request_id.partition("/")[0] in self.aborted_early
                         or transfer.request_id in self.stopped_early)
                if ended:  # free the sender's lease, compute nothing
                    self.connector.acknowledge(transfer.request_id)
                    continue
                request = Request(transfer.request_id, transfer.prompt_token_ids, transfer.params,
                                  transfer.eos_token_ids, transfer.max_total_tokens, transfer.sample_index,
                                  transfer.arrival_time)
                request.output_token_ids.append(transfer.first_token)
                request.prompt_logprobs = None   # the prefill engine delivered them
                try:
                    self.scheduler.add_transferred(request, transfer)
                except ValueError as exc:  # e.g. a duplicate id: refuse this one, keep serving
                    logger.error("refused a transferred request: %s", exc)
                    self.connector.acknowledge(transfer.request_id)
        return outputs

    def _ship_leased(self, outputs: list[EngineCoreOutput]) -> None:
        """Prefill role: send each request that just got its first token, with its prompt's KV."""
        leased = self.scheduler.drain_leased()
        if not leased:
            return
        if self.scheduler.pending_copies:  # a forked sample's tail block must be in place first
            self.runner.copy_blocks(self.scheduler.pending_copies)
        first_logprobs = {o.request_id: o.new_logprobs[0] for o in outputs if o.new_logprobs}
        prompt_logprobs = {o.request_id: o.prompt_logprobs for o in outputs if o.prompt_logprobs is not None}
        for request, block_ids in leased:
            keys, values = extract_kv(self.runner.kv_caches, block_ids, request.num_prompt_tokens)
            host = to_host([*keys, *values])   # from a GPU: through pinned memory, one sync
            keys, values = host[:len(keys)], host[len(keys):]
            peer, instance = self.kv_destinations.get(request.request_id.partition("/")[0], (None, None))
            transfer = KVTransfer(request.request_id, request.prompt_token_ids, request.params,
                                  request.eos_token_ids, request.max_total_tokens, request.arrival_time,
                                  request.output_token_ids[0], request.sample_index, keys, values,
                                  first_logprobs.get(request.request_id), prompt_logprobs.get(request.request_id),
                                  peer=peer, peer_instance=instance)
            try:
                self.connector.send(transfer)
            except Exception as exc:  # e.g. no such decode engine: this request fails, the engine serves on
                logger.error("cannot send the KV of request %s: %s", request.request_id, exc)
                outputs += self.scheduler.abort(request.request_id, RequestStatus.FINISHED_ERROR,
                                                f"the KV handoff failed: {exc}", with_samples=False)
                continue
            self.num_kv_transfer_bytes += transfer.num_bytes
            self.recent_transfer_seconds.append(getattr(self.connector, "last_transfer", (0, 0.0))[1])

    def step(self) -> list[EngineCoreOutput]:
        early = self._exchange_kv()
        plan = self.scheduler.schedule()
        if plan.is_empty:
            return early
        start = time.perf_counter()
        try:
            result = self.runner.execute(plan)
        except Exception as exc:  # one bad batch fails its requests, never the engine
            logger.exception("model runner failed; finishing the %d scheduled requests with an error",
                             len(plan.scheduled))
            outputs = early
            for item in plan.scheduled:
                outputs += self.scheduler.abort(item.request.request_id, RequestStatus.FINISHED_ERROR,
                                                f"internal error while running the model: {exc}")
            return outputs
        self._measure_rates(plan, time.perf_counter() - start)
        outputs = early + self.scheduler.update(plan, result)
        if self.kv_store is not None:
            self._store_published()
        if self.config.role == "prefill":
            self._ship_leased(outputs)
        if plan.kv_inserts:
            self._restate_first_tokens(plan, outputs)
        for item in plan.scheduled:
            computed_end = min(item.start + item.num_new_tokens, item.request.num_prompt_tokens)
            self.num_prompt_tokens += max(0, computed_end - item.start)
        self.num_generated_tokens += sum(len(o.new_token_ids) for o in outputs)
        return outputs

    def _measure_rates(self, plan, seconds: float) -> None:
        """Keep the swap-or-recompute rates current: prefill tokens a second (from steps that are
        mostly prefill) and swap copy bytes a second."""
        if self.swap is None:  # the rates only choose between swap and recompute
            return
        cost = self.swap_cost
        prompt_tokens = sum(i.num_known_tokens for i in plan.scheduled if i.num_known_tokens > 1)
        if prompt_tokens >= 64 and not plan.swap_in and not plan.swap_out:
            cost.prefill_tokens_per_s = 0.8 * cost.prefill_tokens_per_s + 0.2 * prompt_tokens / seconds
        runner = self.runner
        if runner.swap_bytes and runner.swap_seconds:
            cost.copy_bytes_per_s = runner.swap_bytes / runner.swap_seconds

    def _restate_first_tokens(self, plan, outputs: list[EngineCoreOutput]) -> None:
        """Decode role: ack each arrived KV, and report the prefill engine's first token again.

        The two engines' outputs reach the frontend by different routes, so the decode
        side's first output restates the first token (position 0): the frontend keeps
        whichever copy comes first and drops the other.
        """
        by_id = {o.request_id: o for o in outputs}
        for request_id, _, transfer in plan.kv_inserts:
            self.connector.acknowledge(request_id)
            out = by_id.get(request_id)
            request = self.scheduler.requests.get(request_id)
            if out is None or request is None or not out.new_token_ids:
                continue
            out.new_token_ids = [request.output_token_ids[0], *out.new_token_ids]
            out.position = 0
            if out.new_logprobs is not None and transfer.first_logprobs is not None:
                out.new_logprobs = [transfer.first_logprobs, *out.new_logprobs]
            out.prompt_logprobs = transfer.prompt_logprobs
            received = transfer.received_at or request.first_scheduled_time
            out.stages = {"transfer": max(received - transfer.sent_at, 0.0),
                          "admit": max(request.first_scheduled_time - received, 0.0)}

    def stats(self) -> EngineStats:
        pool = self.kv.pool
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting) + len(self.scheduler.waiting_for_kv),
            kv_cache_usage=pool.usage, num_blocks=pool.num_blocks,
            prefix_cache_queries=self.kv.num_queries, prefix_cache_hits=self.kv.num_hits,
            num_preemptions=self.scheduler.num_preemptions, num_generated_tokens=self.num_generated_tokens,
            num_swap_preemptions=self.scheduler.num_swap_preemptions, num_swapped=len(self.scheduler.swapped),
            swap_usage=self.swap.usage if self.swap is not None else 0.0,
            num_prompt_tokens=self.num_prompt_tokens, kv_transfer_bytes=self.num_kv_transfer_bytes,
            kv_transfer_seconds=self._drain_transfer_seconds(), num_kv_leased=len(self.scheduler.leases),
            **self._spec_stats(), **(self.kv_store.stats() if self.kv_store is not None else {}))

    def _spec_stats(self) -> dict:
        spec = self.speculation
        if spec is None:
            return {}
        return dict(spec_num_steps=spec.num_steps, spec_num_draft_tokens=spec.num_draft_tokens,
                    spec_num_accepted_tokens=spec.num_accepted_tokens,
                    spec_accepted_by_position=list(spec.accepted_by_position))

    def load_signature(self) -> tuple[int, ...]:
        """What the gauges show (request counts, free blocks): stats go out as soon as it changes."""
        s = self.scheduler
        return len(s.running), len(s.waiting), len(s.waiting_for_kv), len(s.leases), self.kv.pool.num_free_blocks

    def _drain_transfer_seconds(self) -> list[float]:
        seconds, self.recent_transfer_seconds = self.recent_transfer_seconds, []
        return seconds
