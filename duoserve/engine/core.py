"""EngineCore: one engine's loop, ``step() = schedule -> execute -> update``.

It owns a scheduler (pure bookkeeping) and a model runner (tensors), and its role's
handoff (``duoserve.engine.handoff``: KV to or from another engine, before and after the
step); ``duoserve.engine.builder`` makes and sizes all three. Requests come in already
tokenized; outputs leave as token deltas. The frontend, in this process or another,
turns them into text.
"""

from __future__ import annotations

import contextlib
import logging
import time

from duoserve.config import EngineConfig
from duoserve.core.kv_sources import SwapSource
from duoserve.core.outputs import EngineCoreOutput, SchedulerOutput
from duoserve.core.rates import BATCH_SIZES, PROMPT_SIZES, lookup, record
from duoserve.core.request import Request, RequestStatus
from duoserve.core.scheduler import Scheduler
from duoserve.core.swap_space import SwapCost
from duoserve.engine.cpu_turns import CpuTurns
from duoserve.engine.handoff import Handoff
from duoserve.kv.connector import KVReceiver, KVSender
from duoserve.kv.store import BlockStore, StoreSource
from duoserve.messages import EngineStats
from duoserve.model.fingerprint import describe
from duoserve.model.loader import LoadedModel
from duoserve.structured.cache import GrammarCache
from duoserve.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

CACHED_BLOCKS_INTERVAL = 1.0     # seconds between two reports of the cached block hashes, at least
CACHED_BLOCKS_REPORTED = 8192    # the newest this many (64 KiB in a stats message)


class EngineCore:
    """One engine, built by ``duoserve.engine.builder.build_engine`` from its parts."""

    def __init__(self, *, config: EngineConfig, loaded: LoadedModel, max_model_len: int, scheduler: Scheduler,
                 runner: ModelRunner, handoff: Handoff, store: StoreSource | None = None,
                 swap: SwapSource | None = None, draft=None, memory: dict | None = None,
                 grammars: GrammarCache | None = None, turns: CpuTurns | None = None) -> None:
        self.config = config
        self.loaded = loaded
        self.arch = loaded.arch
        self.tokenizer = loaded.tokenizer
        self.max_model_len = max_model_len
        self.scheduler = scheduler
        self.kv = scheduler.kv
        self.speculation = scheduler.speculation
        self.runner = runner
        self.handoff = handoff   # the role's part in handing KV to or from another engine
        self.store = store       # the shared KV tier, or None
        self.swap = swap
        self.draft = draft       # speculative decoding's draft model, or None
        self.memory = memory or {}   # where the engine's memory goes (builder), for /v1/memory
        self.grammars = grammars     # structured outputs' compiled grammars, or None (no tokenizer)
        self.turns = turns           # turns on cores shared with the other role's engines, or None
        self.num_generated_tokens = 0
        self.num_prompt_tokens = 0
        # measured (moving averages, 0 until measured), by a step's size (core/rates.py): stats
        self.prefill_tokens_per_s = [0.0] * len(PROMPT_SIZES)
        self.decode_step_s = [0.0] * len(BATCH_SIZES)
        self._reported_blocks = (-1, 0.0)   # (pool version, when) of the last cached-blocks report
        self._fingerprint_values: dict | None = None

    @property
    def num_blocks(self) -> int:
        return self.kv.pool.num_blocks

    @property
    def kv_store(self) -> BlockStore | None:
        return self.store.store if self.store is not None else None

    @property
    def swap_cost(self) -> SwapCost | None:
        return self.swap.cost if self.swap is not None else None

    @property
    def num_swap_blocks(self) -> int:
        return self.swap.space.num_blocks if self.swap is not None else 0

    @property
    def connector(self):
        """prefill/decode roles: the KV connector to the other side (``attach_connector``)."""
        return self.handoff.connector

    def attach_connector(self, connector: KVSender | KVReceiver) -> None:
        self.handoff.connector = connector

    def close(self) -> None:
        if self.turns is not None:
            self.turns.close()
        if self.store is not None:
            self.store.store.close()
        if self.grammars is not None:
            self.grammars.close()

    @property
    def fingerprint_values(self) -> dict:
        """What this engine's model fingerprint covers (``describe``), computed once, when first
        asked: the handshake between prefill and decode engines starts from it."""
        if self._fingerprint_values is None:
            self._fingerprint_values = describe(self.arch, self.tokenizer, self.loaded.path, self.loaded.quantization)
        return self._fingerprint_values

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
        self.handoff.route(request.request_id, kv_peer, kv_peer_instance)

    def abort(self, request_id: str) -> list[EngineCoreOutput]:
        """Abort a request and all its samples."""
        if request_id not in self.scheduler.requests:
            self.handoff.ended_early(request_id, whole=True)
        return self.scheduler.abort(request_id)

    def finish_stopped(self, request_id: str) -> None:
        """One sample ended on a stop string (found by the frontend's detokenizer)."""
        if request_id not in self.scheduler.requests:
            self.handoff.ended_early(request_id, whole=False)
        self.scheduler.abort(request_id, RequestStatus.FINISHED_STOPPED, with_samples=False)

    def release(self, request_id: str) -> None:
        """The frontend has taken a finished request's last output: forget it."""
        if request_id not in self.scheduler.requests:
            self.handoff.ended_early(request_id, whole=True)
        self.scheduler.forget(request_id)
        self.handoff.forget(request_id)

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
        return self.scheduler.has_work

    def step(self) -> list[EngineCoreOutput]:
        early = self.handoff.before_step()
        plan = self.scheduler.schedule()
        if plan.is_empty:
            if self.grammars is not None and self.grammars.compiling:   # only grammars to wait for
                self.grammars.wait(0.05)
            return early
        try:
            with self._turn():
                start = time.perf_counter()   # after the turn came: the rates are the step's own
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
        if self.store is not None:
            self.store.write_published(self.runner.kv_caches)
        self.handoff.after_step(plan, outputs)
        for item in plan.scheduled:
            computed_end = min(item.start + item.num_new_tokens, item.request.num_prompt_tokens)
            self.num_prompt_tokens += max(0, computed_end - item.start)
        self.num_generated_tokens += sum(len(o.new_token_ids) for o in outputs)
        return outputs

    def _turn(self):
        """The cores for one step: at once, or in turn with the other role's engines."""
        if self.turns is None:
            return contextlib.nullcontext()
        return self.turns.step()

    def _measure_rates(self, plan: SchedulerOutput, seconds: float) -> None:
        """Keep the measured rates current: prompt tokens a second (from steps that compute 32
        or more) and a step of decodes alone, each by the step's size (placement, in the stats);
        the swap-or-recompute choice's prefill tokens a second (from steps mostly of prompts) and
        copy bytes a second."""
        prompt_tokens = sum(i.num_known_tokens for i in plan.scheduled if i.num_known_tokens > 1)
        decodes = sum(1 for i in plan.scheduled if i.num_known_tokens == 1)
        if prompt_tokens >= PROMPT_SIZES[0]:
            # the prompts' own share of a step that also decodes: what a prompt adds to a step
            alone = lookup(self.decode_step_s, BATCH_SIZES, decodes) if decodes else 0.0
            own = max(seconds - alone, seconds / 2)
            record(self.prefill_tokens_per_s, PROMPT_SIZES, prompt_tokens, prompt_tokens / own)
        elif prompt_tokens == 0 and decodes and not plan.swap_in and not plan.swap_out:
            record(self.decode_step_s, BATCH_SIZES, decodes, seconds)
        if self.swap is None:  # the rest only chooses between swap and recompute
            return
        cost = self.swap.cost
        if prompt_tokens >= 64 and not plan.swap_in and not plan.swap_out:
            cost.prefill_tokens_per_s = 0.8 * cost.prefill_tokens_per_s + 0.2 * prompt_tokens / seconds
        runner = self.runner
        if runner.swap_bytes and runner.swap_seconds:
            cost.copy_bytes_per_s = runner.swap_bytes / runner.swap_seconds

    def stats(self) -> EngineStats:
        pool, scheduler = self.kv.pool, self.scheduler
        return EngineStats(
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting) + len(scheduler.waiting_for_kv),
            kv_cache_usage=pool.usage, num_blocks=pool.num_blocks,
            prefix_cache_queries=self.kv.num_queries, prefix_cache_hits=self.kv.num_hits,
            num_preemptions=scheduler.num_preemptions, num_generated_tokens=self.num_generated_tokens,
            num_swap_preemptions=scheduler.num_swap_preemptions, num_swapped=len(scheduler.swapped),
            swap_usage=self.swap.space.usage if self.swap is not None else 0.0,
            num_prompt_tokens=self.num_prompt_tokens, kv_transfer_bytes=self.handoff.num_transfer_bytes,
            kv_transfer_seconds=self.handoff.drain_transfer_seconds(), num_kv_leased=scheduler.num_leased,
            prefill_tokens_per_s=self.prefill_tokens_per_s, decode_step_s=self.decode_step_s,
            handoff_s_per_token=self.handoff.seconds_per_token, cached_blocks=self._cached_blocks(),
            **self._spec_stats(), **(self.store.store.stats() if self.store is not None else {}),
            **(self.runner.grammar_masks.stats() if self.runner.grammar_masks is not None else {}))

    def _cached_blocks(self) -> list[int] | None:
        """The prefix cache's block hashes for the stats, when they changed (at most once a
        CACHED_BLOCKS_INTERVAL); else None."""
        pool = self.kv.pool
        version, at = self._reported_blocks
        now = time.monotonic()
        if not pool.enable_caching or pool.version == version or now - at < CACHED_BLOCKS_INTERVAL:
            return None
        self._reported_blocks = (pool.version, now)
        newest = list(pool.cached)[-CACHED_BLOCKS_REPORTED:]   # the dict keeps the order they came in
        return [int.from_bytes(h[:8], "little") for h in newest]

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
        return len(s.running), len(s.waiting), len(s.waiting_for_kv), s.num_leased, self.kv.pool.num_free_blocks
