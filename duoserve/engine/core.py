"""EngineCore: one engine's loop, ``step() = schedule -> execute -> update``.

It owns a scheduler (pure bookkeeping) and a model runner (tensors), and its role's
handoff (``duoserve.engine.handoff``: KV to or from another engine, before and after the
step); ``duoserve.engine.builder`` makes and sizes all three. What it measures of its steps
and reports in its stats is ``duoserve.engine.measures``. Requests come in already
tokenized; outputs leave as token deltas. The frontend, in this process or another,
turns them into text.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time

from duoserve.config import EngineConfig
from duoserve.core.kv_sources import SwapSource
from duoserve.core.outputs import EngineCoreOutput
from duoserve.core.request import Request, RequestStatus
from duoserve.core.scheduler import Scheduler
from duoserve.core.swap_space import SwapCost
from duoserve.engine.cpu_turns import CpuTurns
from duoserve.engine.handoff import Handoff
from duoserve.engine.measures import EngineMeasures
from duoserve.errors import DuoserveError
from duoserve.kv.connector import KVReceiver, KVSender
from duoserve.kv.store import BlockStore, StoreSource
from duoserve.messages import EngineStats
from duoserve.model.fingerprint import describe
from duoserve.model.loader import LoadedModel
from duoserve.model.lora import LoRALoadError
from duoserve.structured.cache import GrammarCache
from duoserve.worker.lora import adapter_problem
from duoserve.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class AdapterRefused(DuoserveError, ValueError):
    """A request for a LoRA adapter this engine has not loaded."""


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
        self.store = store       # the KV tiers (disk, Redis), or None
        self.swap = swap
        self.draft = draft       # speculative decoding's draft model, or None
        self.memory = memory or {}   # where the engine's memory goes (builder), for /v1/memory
        self.grammars = grammars     # structured outputs' compiled grammars, or None (no tokenizer)
        self.turns = turns           # turns on cores shared with the other role's engines, or None
        self.measures = EngineMeasures(swap, runner)   # its steps' rates and token counts, its stats
        self._fingerprint_values: dict | None = None

    @property
    def num_blocks(self) -> int:
        return self.kv.pool.num_blocks

    @property
    def kv_store(self) -> BlockStore | None:
        """The Redis tier's store, if the engine has one."""
        return self.store.tier("kv_store") if self.store is not None else None

    @property
    def kv_disk(self) -> BlockStore | None:
        """The disk tier's store, if the engine has one."""
        return self.store.tier("kv_disk") if self.store is not None else None

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
            for store in self.store.stores:
                store.close()
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
    def reranker(self) -> str | None:
        return self.loaded.reranker

    @property
    def vocab_size(self) -> int:
        return self.arch.vocab_size

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        if self.tokenizer is not None and self.tokenizer.eos_token_ids:
            return self.tokenizer.eos_token_ids
        return self.arch.eos_token_ids

    def add_request(self, request: Request, kv_peer: str | None = None, kv_peer_instance: str | None = None) -> None:
        """Take a request; ``AdapterRefused`` (nothing taken) for a LoRA adapter not loaded here."""
        name = request.params.lora_name
        if name is not None:
            problem = adapter_problem(self.runner.lora, name, in_use=self.adapter_in_use)
            if problem is not None:
                raise AdapterRefused(problem)
            # the adapter's identity: its KV's block hashes and any handoff are keyed by it
            request.params = dataclasses.replace(request.params, lora_digest=self.runner.lora.digest(name))
        self.scheduler.add_request(request)
        self.handoff.route(request.request_id, kv_peer, kv_peer_instance)

    def change_adapter(self, name: str, path: str | None) -> tuple[str, str | None]:
        """Load LoRA adapter ``name`` from ``path``, or unload it (path None): ("stop", None) done,
        ("abort", why) refused because requests use it, ("error", why) refused otherwise."""
        lora = self.runner.lora
        if lora is None:
            return "error", "this engine serves no LoRA adapters: start it with --enable-lora"
        if path is None:
            if name not in lora.adapters:
                return "error", f"LoRA adapter {name!r} is not loaded"
            if self.adapter_in_use(name):
                return "abort", f"LoRA adapter {name!r} has requests in this engine"
            lora.unload(name)
            return "stop", None
        try:
            lora.load(name, path, in_use=self.adapter_in_use)
        except LoRALoadError as exc:
            return "error", str(exc)
        return "stop", None

    def adapter_in_use(self, name: str) -> bool:
        return any(r.params.lora_name == name for r in self.scheduler.requests.values())

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
        early = self.handoff.before_step() + self.scheduler.expire_deadlines(time.monotonic())
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
        seconds = time.perf_counter() - start
        self.measures.step_took(plan, seconds)
        self.scheduler.observe_step(plan.num_batched_tokens, seconds)
        outputs = early + self.scheduler.update(plan, result)
        if self.store is not None:
            self.store.write_published(self.runner.kv_caches)
        self.handoff.after_step(plan, outputs)
        self.measures.count(plan, outputs)
        return outputs

    def _turn(self):
        """The cores for one step: at once, or in turn with the other role's engines."""
        if self.turns is None:
            return contextlib.nullcontext()
        return self.turns.step()

    def stats(self) -> EngineStats:
        return self.measures.stats(self)

    def load_signature(self) -> tuple[int, ...]:
        """What the gauges show (request counts, free blocks): stats go out as soon as it changes."""
        s = self.scheduler
        return len(s.running), len(s.waiting), len(s.waiting_for_kv), s.num_leased, self.kv.pool.num_free_blocks
