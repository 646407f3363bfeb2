"""Build an ``EngineCore``: load the model, size the KV pool, choose the parts, report memory.

Everything an engine's role and configuration decide is decided here, once: which KV
sources admission asks (``duoserve.core.kv_sources``), the role's scheduling policy
(``duoserve.core.roles``) and its handoff (``duoserve.engine.handoff``). The engine that
comes out only steps.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import time

import torch

from duoserve.config import EngineConfig, LoRAConfig, Role
from duoserve.core.kv_cache_manager import KVCacheManager, window_to_free
from duoserve.core.kv_sources import KVSource, PrefixCacheSource, SwapSource
from duoserve.core.scheduler import Scheduler, SchedulerSetup
from duoserve.core.speculation import SpeculationPolicy
from duoserve.core.swap_space import SwapCost, SwapSpace
from duoserve.engine.core import EngineCore
from duoserve.engine.cpu_turns import CpuTurns
from duoserve.engine.role_parts import role_parts
from duoserve.errors import ConfigError
from duoserve.kv.disk_tier import DiskTier
from duoserve.kv.store import BlockStore, RedisTier, StoreSource
from duoserve.model.encoder import EncoderArch
from duoserve.model.fingerprint import describe, fingerprint
from duoserve.model.loader import LoadedModel, check_max_model_len, weight_bytes
from duoserve.model.lora import LoRALoadError
from duoserve.model.paths import resolve_model_path
from duoserve.platform import resolve
from duoserve.structured.cache import GrammarCache
from duoserve.structured.grammar import GrammarCompiler
from duoserve.worker.backends import load_model
from duoserve.worker.draft import DraftRunner, load_draft
from duoserve.worker.grammar_masks import GrammarMasks
from duoserve.worker.kv_cache import bytes_per_token, plan_kv_pool
from duoserve.worker.lora import LoRAManager
from duoserve.worker.memory import (estimate_prefill_scratch, measure_prefill_scratch, rss_bytes, scratch_measured,
                                    tensor_resident_bytes)
from duoserve.worker.encoder_runner import EncoderRunner
from duoserve.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

ENCODER_STEP_TOKENS = 2048   # a cross-encoder's default step: the pairs of a rerank request computed together


def build_engine(config: EngineConfig, loaded: LoadedModel | None = None) -> EngineCore:
    """An engine for ``config``; ``loaded``: a model loaded already (tests share one)."""
    return EngineBuilder(config, loaded).build()


class EngineBuilder:
    """The steps of one build, in order; each step's results are the next steps' inputs."""

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        self.config = config
        self.start = time.monotonic()
        self.runtime_bytes = rss_bytes() if loaded is None else None  # the process before the model
        # every "auto" of the config resolved once, here: the run-time record what follows reads
        self.runtime = resolve(config.model, loaded.path if loaded else resolve_model_path(config.model.model),
                               config.cache, dtype=None if loaded is None else str(loaded.dtype).removeprefix("torch."))
        self.device = self.runtime.device
        self.loaded = loaded or load_model(dataclasses.replace(config.model, device=self.device), self.runtime)
        self.max_model_len = check_max_model_len(self.loaded.arch, config.model.max_model_len)
        self.budget = config.scheduler.token_budget(self.max_model_len)
        cache = config.cache
        self.kv_dtype = self.runtime.torch_kv_dtype
        if isinstance(self.loaded.arch, EncoderArch):   # no KV: nothing to size or swap
            return
        self.block_bytes = bytes_per_token(self.loaded.arch, self.kv_dtype) * cache.block_size
        self.num_swap_blocks = int(cache.swap_space * (1 << 30)) // self.block_bytes

    def build(self) -> EngineCore:
        config, cache, loaded = self.config, self.config.cache, self.loaded
        if isinstance(loaded.arch, EncoderArch):
            return self._build_encoder()
        parts = role_parts(config.role)   # what the role puts into the engine
        spec = config.speculative if parts.decodes else None
        draft = None  # speculative decoding's draft model
        if spec is not None and spec.method == "draft":
            draft = load_draft(spec, config.model, loaded, self.max_model_len)
        pool = plan_kv_pool(loaded.arch, cache, self.kv_dtype, self.device, self.max_model_len,
                            config.model.max_model_len is not None, draft.arch if draft else None)
        if pool.note:
            logger.info("%s", pool.note)
        num_blocks, self.max_model_len, self.kv_sizing = pool.num_blocks, pool.max_model_len, pool.note
        self.budget = config.scheduler.token_budget(self.max_model_len)
        window, self.window_freeing = window_to_free([loaded.arch.window(i) for i in range(loaded.arch.num_layers)],
                                                     config.role, draft is not None)
        kv = KVCacheManager(num_blocks, cache.block_size, cache.enable_prefix_caching, window)
        store = self._open_store(kv) if config.kv_store is not None or config.kv_disk is not None else None
        swap = SwapSource(SwapSpace(self.num_swap_blocks), SwapCost(self.block_bytes)) if self.num_swap_blocks else None
        grammars = self._grammars()
        scheduler = Scheduler(SchedulerSetup(
            kv=kv, max_num_batched_tokens=self.budget, max_num_seqs=config.scheduler.max_num_seqs,
            enable_chunked_prefill=config.scheduler.enable_chunked_prefill,
            sources=_sources(config, kv, store, swap), swap=swap, role=parts.policy(config, kv),
            speculation=SpeculationPolicy(spec) if spec else None, ready=grammars.ready if grammars else None,
            policy=config.scheduler.policy, tenant_weights=config.scheduler.tenant_weights,
            step_seconds=config.scheduler.step_seconds))
        runner = self._runner(num_blocks, draft)
        if grammars is not None:
            runner.grammar_masks = GrammarMasks(grammars, loaded.arch.vocab_size)
        engine = EngineCore(config=config, loaded=loaded, max_model_len=self.max_model_len, scheduler=scheduler,
                            runner=runner, handoff=parts.handoff(config, scheduler, runner), store=store, swap=swap,
                            draft=draft, memory=self._memory_report(runner, num_blocks, draft), grammars=grammars,
                            turns=self._turns(runner))
        # The model, its compiled graph and the tokenizer are millions of long-lived objects: moved
        # out of the garbage collector's sight, a collection during a step scans only new ones.
        gc.collect()
        gc.freeze()
        logger.info("engine ready in %.1fs: %s, %d KV blocks of %d tokens, budget %d tokens/step, scheduling %s",
                    time.monotonic() - self.start, loaded.path.name, num_blocks, cache.block_size, self.budget,
                    config.scheduler.policy)
        return engine

    def _build_encoder(self) -> EngineCore:
        """A cross-encoder's engine: a sequence is computed whole in one step, attending both ways,
        and keeps nothing, so chunking, the prefix cache, swap and the KV tiers do not apply. Its
        blocks are bookkeeping only: with enough of them for every sequence of a full batch, the
        scheduler's batch and token caps alone decide a step."""
        config, cache, loaded = self.config, self.config.cache, self.loaded
        if config.role != Role.COLOCATED:
            raise ConfigError("role", str(config.role), "colocated: a cross-encoder computes a pair whole, it has "
                              "no prefill and decode to split")
        for field, value, plain in (("speculative", config.speculative, None), ("kv_store", config.kv_store, None),
                                    ("kv_disk", config.kv_disk, None)):
            if value != plain:
                raise ConfigError(field, "set", f"unset for a cross-encoder ({loaded.arch.architecture}), which "
                                  "generates nothing and keeps no KV")
        given = config.scheduler.max_num_batched_tokens
        if given is not None and given < self.max_model_len:
            raise ConfigError("max_num_batched_tokens", given, f"at least max_model_len ({self.max_model_len}): a "
                              "cross-encoder computes a sequence in one step")
        # many short pairs in one forward: the matmuls of a step go faster per token than the batch of one
        self.budget = given or max(self.max_model_len, ENCODER_STEP_TOKENS)
        num_blocks = config.scheduler.max_num_seqs * -(-self.max_model_len // cache.block_size)
        kv = KVCacheManager(num_blocks, cache.block_size, enable_caching=False)
        scheduler = Scheduler(SchedulerSetup(
            kv=kv, max_num_batched_tokens=self.budget, max_num_seqs=config.scheduler.max_num_seqs,
            enable_chunked_prefill=False, sources=[], swap=None, role=role_parts(Role.COLOCATED).policy(config, kv),
            policy=config.scheduler.policy, tenant_weights=config.scheduler.tenant_weights))
        runner = EncoderRunner(loaded, self.device)
        self.weights = weight_bytes(loaded.model)
        scratch_tokens = min(self.budget, self.max_model_len)
        scratch = measure_prefill_scratch(lambda: runner.scratch_forward(scratch_tokens), torch.empty(0)) if (
            self.device == "cpu" and scratch_measured()) else None
        memory = {"weights_bytes": {kind: size for kind, size in self.weights.items() if size},
                  "kv_pool": {"blocks": 0, "block_size": cache.block_size, "tokens": 0, "bytes": 0,
                              "max_model_len": self.max_model_len, "sizing": "none: a cross-encoder keeps no KV"},
                  "swap": {"blocks": 0, "bytes": 0}, "prefill_scratch_bytes": scratch,
                  "prefill_scratch_tokens": scratch_tokens, "prefill_scratch_measured": scratch is not None,
                  "runtime_bytes": self.runtime_bytes, "rss_bytes": rss_bytes() if self.device == "cpu" else None,
                  "pid": os.getpid()}
        engine = EngineCore(config=config, loaded=loaded, max_model_len=self.max_model_len, scheduler=scheduler,
                            runner=runner, handoff=role_parts(Role.COLOCATED).handoff(config, scheduler, runner),
                            memory=memory)
        gc.collect()
        gc.freeze()
        logger.info("cross-encoder engine ready in %.1fs: %s (%s), up to %d tokens a step, weights %.0f MB",
                    time.monotonic() - self.start, loaded.path.name, loaded.arch.architecture, self.budget,
                    sum(self.weights.values()) / 2 ** 20)
        return engine

    def _turns(self, runner: ModelRunner) -> CpuTurns | None:
        """Its turns on cores shared with the other role's engines (its role's: role_parts)."""
        return role_parts(self.config.role).turns(self.config, self.loaded.model.layers, runner.compiled)

    def _grammars(self) -> GrammarCache | None:
        """Structured outputs' grammars over this model's vocabulary (none without a tokenizer:
        the frontend refuses such requests)."""
        tokenizer = self.loaded.tokenizer
        if tokenizer is None:
            return None
        eos = tokenizer.eos_token_ids or self.loaded.arch.eos_token_ids
        return GrammarCache(GrammarCompiler(tokenizer, self.loaded.arch.vocab_size, eos))

    def _runner(self, num_blocks: int, draft) -> ModelRunner:
        """The model runner with its KV pool (and swap space, and draft runner); measures what
        loading left resident on the way (``self.weights``, ``self.loading_bytes``)."""
        config, cache = self.config, self.config.cache
        compile_model = config.compile and self.device == "cpu"
        runner = ModelRunner(self.loaded, num_blocks, cache.block_size, self.kv_dtype, self.device,
                             config.model.seed, compile_model=compile_model)
        self.weights = weight_bytes(self.loaded.model)   # by kind, once: loading and the report both need it
        self.loading_bytes = self._loading_bytes(runner, sum(self.weights.values()))
        if self.num_swap_blocks:
            runner.allocate_swap(self.num_swap_blocks, cache.block_size, self.kv_dtype)
        if config.lora is not None:
            runner.lora = self._adapters(config.lora)
        if draft is not None:
            runner.drafter = DraftRunner(draft, num_blocks, cache.block_size, self.kv_dtype, self.device,
                                         config.model.seed, compile_model, max_catch_up=self.budget)
        return runner

    def _adapters(self, config: LoRAConfig) -> LoRAManager:
        """The LoRA adapters' hooks on the model, and the adapters given at start (a bad one is a
        config error naming it)."""
        loaded = self.loaded
        manager = LoRAManager(loaded.model, loaded.arch, config, loaded.dtype, loaded.gguf_arch)
        for name, path in config.modules:
            try:
                manager.load(name, path)
            except LoRALoadError as exc:
                raise ConfigError("lora_modules", f"{name}={path}", f"an adapter this model can serve: {exc}") \
                    from None
        return manager

    def _open_store(self, kv: KVCacheManager) -> StoreSource:
        """The KV tiers (disk first, then Redis), keyed by this model's fingerprint and KV layout;
        they extend the prefix cache, whose block hashes they use."""
        config, arch = self.config, self.loaded.arch
        if not config.cache.enable_prefix_caching:
            flag = "--kv-store" if config.kv_store is not None else "--kv-disk-path"
            raise ConfigError("enable_prefix_caching", False, f"on with {flag} (the tier keeps the prefix "
                              "cache's blocks)")
        digest = fingerprint(describe(arch, self.loaded.tokenizer, self.loaded.path, self.loaded.quantization))
        layout = {"dtype": str(self.kv_dtype), "block_size": config.cache.block_size, "num_layers": arch.num_layers,
                  "num_kv_heads": arch.num_kv_heads, "head_dim": arch.head_dim}
        stores = []
        if config.kv_disk is not None:
            stores.append(BlockStore(config.kv_disk, DiskTier(config.kv_disk.path, config.kv_disk.max_bytes), digest,
                                     layout))
        if config.kv_store is not None:
            stores.append(BlockStore(config.kv_store, RedisTier(config.kv_store), digest, layout))
        return StoreSource(stores, kv)

    def _loading_bytes(self, runner: ModelRunner, weights: int) -> int | None:
        """What loading the model and building its runner left resident beyond the weights and
        the KV pages: the tokenizer, the loader's leftovers, compiled code (before any request)."""
        if self.runtime_bytes is None or self.device != "cpu":
            return None
        kv_pages = tensor_resident_bytes(runner.kv_caches[0][0])  # one buffer holds every layer's
        return rss_bytes() - self.runtime_bytes - weights - kv_pages

    def _memory_report(self, runner: ModelRunner, num_blocks: int, draft) -> dict:
        """Where this engine's memory goes (``duoserve.worker.memory``), logged once at start;
        served at ``/v1/memory`` and as ``duoserve:memory_bytes``."""
        block_size, per_block, on_cpu = self.config.cache.block_size, self.block_bytes, self.device == "cpu"
        kv_buffer = runner.kv_caches[0][0]
        scratch_tokens = min(self.budget, self.max_model_len)
        measured = on_cpu and scratch_measured()
        if measured:
            scratch = measure_prefill_scratch(lambda: runner.scratch_forward(scratch_tokens), kv_buffer)
        else:
            scratch = estimate_prefill_scratch(self.loaded.arch, scratch_tokens, self.loaded.dtype.itemsize)
        report = {
            "weights_bytes": {kind: size for kind, size in self.weights.items() if size},
            "kv_pool": {"blocks": num_blocks, "block_size": block_size, "tokens": num_blocks * block_size,
                        "dtype": str(self.kv_dtype).removeprefix("torch."), "bytes": num_blocks * per_block,
                        "resident_bytes": tensor_resident_bytes(kv_buffer) if on_cpu else None,
                        "max_model_len": self.max_model_len, "sizing": self.kv_sizing,
                        "window_freeing": self.window_freeing},
            "swap": {"blocks": self.num_swap_blocks, "bytes": self.num_swap_blocks * per_block},
            "prefill_scratch_bytes": scratch, "prefill_scratch_tokens": scratch_tokens,
            "prefill_scratch_measured": measured and scratch is not None,
            "runtime_bytes": self.runtime_bytes, "loading_bytes": self.loading_bytes,
            "rss_bytes": rss_bytes() if on_cpu else None,
            "pid": os.getpid(),   # which process this is (operators, the chaos tests)
        }
        if draft is not None:
            report["draft_weights_bytes"] = sum(weight_bytes(draft.model).values())
        _log_memory(report)
        return report


def _sources(config: EngineConfig, kv: KVCacheManager, store: StoreSource | None,
             swap: SwapSource | None) -> list[KVSource]:
    """The KV sources admission asks, in order: the prefix cache before the store that extends it."""
    sources: list[KVSource] = []
    if config.cache.enable_prefix_caching:
        sources.append(PrefixCacheSource(kv))
    if store is not None:
        sources.append(store)
    if swap is not None:
        sources.append(swap)
    return sources + role_parts(config.role).kv_sources()


def _log_memory(report: dict) -> None:
    mb = 2 ** 20

    def size(value: int | None) -> str:
        return "?" if value is None else f"{value / mb:.0f}"

    logger.info("memory: weights %.0f MB, KV pool %.0f MB reserved (%d tokens of %s), swap %.0f MB, "
                "prefill scratch %s MB (%d tokens, %s), runtime %s MB, loading %s MB, resident %s MB",
                sum(report["weights_bytes"].values()) / mb, report["kv_pool"]["bytes"] / mb,
                report["kv_pool"]["tokens"], report["kv_pool"]["dtype"], report["swap"]["bytes"] / mb,
                size(report["prefill_scratch_bytes"]), report["prefill_scratch_tokens"],
                "measured" if report["prefill_scratch_measured"] else "estimated",
                size(report["runtime_bytes"]), size(report["loading_bytes"]), size(report["rss_bytes"]))
