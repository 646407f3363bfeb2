"""The models a server serves, each loaded when asked for and unloaded when not needed.

One model (the usual ``duoserve serve``) is a registry of one, loaded before the port opens. With
several (``--model NAME=PATH`` again, ``--models-dir``), each request picks one by its ``model``
field: a model not loaded is loaded first (``--models-autoload``), loading one past
``--models-max`` first unloads the least recently used, and ``--sleep-idle-seconds`` ends the
engines of a model idle that long. Every load is a fresh engine group (``AsyncEngine``) with its
own API surfaces (``served_model.ServedModel``); an unloaded model is its engines ended, as at shutdown, so no
engine process outlives its model. A model stays loaded while it has requests in flight: an
unload waits for them up to ``--shutdown-timeout``, then ends them with an error.

Loads and unloads take turns under one lock; requests to models already loaded never wait on it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.metrics_core import Metric

from duoserve.config import ClusterConfig, DisaggConfig
from duoserve.entrypoints.errors import APIError
from duoserve.entrypoints.responses_store import RedisResponseStore, ResponseStore
from duoserve.entrypoints.served_model import ModelSpec, ServedModel, Surfaces
from duoserve.entrypoints.server_config import MODEL_NAME, ModelsConfig, ServerConfig
from duoserve.errors import ConfigError
from duoserve.frontend.adapters import AdapterChangeError
from duoserve.frontend.admission import Admission
from duoserve.frontend.async_engine import AsyncEngine
from duoserve.frontend.engine_client import EngineClient, EngineStartError
from duoserve.metrics import ServerMetrics

logger = logging.getLogger("duoserve.api")

# the frontend's requests by class: the server's whatever their model (ModelRegistry.admission)
SERVER_WIDE = ("duoserve:class_requests_waiting", "duoserve:class_requests_running", "duoserve:requests_refused")
STATES = ("loaded", "loading", "unloading", "unloaded", "sleeping")
LOAD_TIMEOUT_S = 600.0   # a model whose engines are not up by then failed to load


@dataclass
class ModelEntry:
    spec: ModelSpec
    metrics: ServerMetrics
    tracer: object | None = None
    state: str = "unloaded"
    served: ServedModel | None = None     # while loaded or unloading
    starting: AsyncEngine | None = None   # while loading: ended too if the server stops meanwhile
    last_used: float = field(default_factory=time.monotonic)
    freed_bytes: int | None = None        # the engines' resident size when it last unloaded or slept
    error: str | None = None              # why its last load failed


class ModelRegistry:
    def __init__(self, specs: list[ModelSpec], server: ServerConfig, disagg: DisaggConfig | None = None,
                 cluster: ClusterConfig | None = None, limits: ModelsConfig | None = None) -> None:
        self.server, self.disagg, self.cluster = server, disagg, cluster
        self.limits = limits or ModelsConfig()
        self.admission = Admission(server.max_waiting_per_tenant, server.max_waiting)   # server-wide caps
        kv_store = specs[0].engine_config.kv_store
        self.store = RedisResponseStore(kv_store.url) if kv_store else ResponseStore()
        self.entries = {spec.name: ModelEntry(spec, ServerMetrics(request_class=self.admission.classes.get,
                                                                  model_name=spec.name), self._tracer(spec.name))
                        for spec in specs}
        self.single = len(specs) == 1
        # a LoRA adapter's name -> (its base model's, its path): a request names either (vLLM's way)
        self.adapters: dict[str, tuple[str, str]] = {}
        self.unloading: set[str] = set()   # adapters no new request gets
        for spec in specs:
            for adapter, path in spec.engine_config.lora.modules if spec.engine_config.lora else ():
                self.add_adapter(adapter, spec.name, path)
        self.collector = CollectorRegistry()
        self.collector.register(_ModelsCollector(self))
        self._counters(self.collector)
        self._lock: asyncio.Lock | None = None   # made on the server's loop
        self._watcher: asyncio.Task | None = None
        self.stopping = False

    def _tracer(self, name: str):
        if not self.server.otlp_traces_endpoint:   # imported only when asked for: no cost when off
            return None
        from duoserve.tracing import RequestTracer

        return RequestTracer(self.server.otlp_traces_endpoint, name, self.admission.classes.get)

    def _counters(self, r: CollectorRegistry) -> None:
        self.loads = Counter("duoserve:model_loads", "Models loaded (their engines started)", ["model_name"],
                             registry=r)
        self.unloads = Counter("duoserve:model_unloads", "Models unloaded (their engines ended), by why: "
                               "models_max, request (POST /models/unload) or idle (--sleep-idle-seconds)",
                               ["model_name", "reason"], registry=r)
        self.load_failures = Counter("duoserve:model_load_failures", "Model loads that failed", ["model_name"],
                                     registry=r)
        self.state_gauge = Gauge("duoserve:model_state", "1 for each model's current state", ["model_name", "state"],
                                 registry=r)
        self.lora_info = Gauge("vllm:lora_requests_info", "The LoRA adapters with requests running and waiting "
                               "(vLLM's; the value: when it was read)", ["running_lora_adapters",
                                                                         "waiting_lora_adapters", "max_lora"],
                               registry=r)
        self.lora_requests = Gauge("duoserve:lora_requests", "Requests in flight by LoRA adapter and state (waiting "
                                   "for their first token, or running)", ["adapter", "state"], registry=r)
        for entry in self.entries.values():
            self._set_state(entry, entry.state)

    # ---- lookups ---------------------------------------------------------------------------

    @property
    def lock(self) -> asyncio.Lock:
        if self._lock is None:
            self._lock = asyncio.Lock()
        return self._lock

    def names(self) -> str:
        return ", ".join(f"`{name}`" for name in self.entries)

    def entry(self, name: str | None) -> ModelEntry:
        """The model a request names: 404 for one not served; with several, 400 for none."""
        if name is None or (self.single and name == ""):
            if not self.single:
                raise APIError(400, f"give 'model': this server serves {self.names()}", param="model")
            return next(iter(self.entries.values()))
        entry = self.entries.get(name)
        if entry is None:
            raise APIError(404, f"The model `{name}` does not exist; this server serves {self.names()}",
                           param="model", code="model_not_found")
        return entry

    def resolve(self, name: str | None) -> tuple[ModelEntry, str | None]:
        """(the model, the adapter or None) a request's ``model`` names."""
        if name is not None and name in self.adapters and name not in self.unloading:
            return self.entries[self.adapters[name][0]], name
        return self.entry(name), None

    def add_adapter(self, adapter: str, model: str, path: str) -> None:
        if adapter in self.entries or self.adapters.get(adapter, (model,))[0] != model:
            raise ConfigError("lora_modules", adapter, "a name no model and no other model's adapter has")
        self.adapters[adapter] = (model, path)

    def loaded(self) -> list[ModelEntry]:
        return [e for e in self.entries.values() if e.served is not None]

    def clients(self) -> list[EngineClient]:
        """Every engine of every model loaded or loading now."""
        engines = [e.served.engine for e in self.loaded()] + [e.starting for e in self.entries.values()
                                                               if e.starting is not None]
        return [client for engine in engines for client in engine.clients]

    def _set_state(self, entry: ModelEntry, state: str) -> None:
        entry.state = state
        for each in STATES:
            self.state_gauge.labels(entry.spec.name, each).set(1 if each == state else 0)

    # ---- serving ----------------------------------------------------------------------------

    @asynccontextmanager
    async def use(self, name: str | None) -> AsyncIterator[Surfaces]:
        """The surfaces of the model (or adapter) a request names, the model loaded (first, where
        it is not) and held loaded until the request has handed its streams to the engines."""
        entry, adapter = self.resolve(name)
        if entry.state != "loaded":
            if entry.state == "unloaded" and not self.limits.models_autoload:
                raise APIError(400, f"the model `{entry.spec.name}` is not loaded: POST /models/load first "
                               "(this server runs with --no-models-autoload)", param="model", code="model_not_loaded")
            await self.load_for_request(entry)
        served = entry.served
        served.leases += 1
        entry.last_used = time.monotonic()
        try:
            yield served.surface(adapter)
        finally:
            served.leases -= 1
            entry.last_used = time.monotonic()

    async def load_for_request(self, entry: ModelEntry) -> None:
        try:
            await self.load(entry.spec.name)
        except APIError:
            raise
        except Exception as exc:   # the engines' own error, one line: the server goes on serving the others
            raise APIError(503, f"the model `{entry.spec.name}` failed to load: {exc}", param="model",
                           code="model_load_failed") from None

    # ---- loading and unloading ------------------------------------------------------------

    async def start(self) -> None:
        """Load the models that load on start-up (in order, up to --models-max) and begin watching
        for idle ones. A failure to start is raised: the server does not open its port."""
        for entry in [e for e in self.entries.values() if e.spec.load_on_startup][:self.limits.models_max]:
            await self.load(entry.spec.name, wait=not self.single)
        if self.limits.sleep_idle_seconds is not None and self._watcher is None:
            self._watcher = asyncio.create_task(self._sleep_idle(self.limits.sleep_idle_seconds),
                                                name="duoserve-sleep-idle")

    async def load(self, name: str, wait: bool = True) -> None:
        """Start the model's engines (first unloading the least recently used model past
        --models-max); with ``wait``, return once they serve. A model loaded already is left as is."""
        entry = self.entry(name)
        async with self.lock:
            if entry.served is not None and entry.state == "loaded":
                return
            if self.stopping:
                raise APIError(503, "the server is shutting down")
            before = entry.state
            self._set_state(entry, "loading")
            try:
                await self._make_room(entry)
                engine = self._engine(entry)
                entry.starting = engine
                try:
                    await asyncio.wait_for(engine.start(wait=wait), LOAD_TIMEOUT_S)
                except EngineStartError:
                    raise   # the supervisor stopped what it started
                except BaseException:
                    await engine.shutdown()
                    raise
            except BaseException as exc:
                entry.error = str(exc) or type(exc).__name__
                self.load_failures.labels(name).inc()
                self._set_state(entry, before)
                raise
            finally:
                entry.starting = None
            entry.served, entry.error = ServedModel(entry.spec, engine, self.store), None
            entry.last_used = time.monotonic()
            self._set_state(entry, "loaded")
            self.loads.labels(name).inc()
            logger.info("model %s loaded (%s)", name, "ready" if engine.ready else engine.not_ready_reason())

    def _engine(self, entry: ModelEntry) -> AsyncEngine:
        """A new engine group for the model, reporting to its metrics (kept across loads)."""
        engine = AsyncEngine(entry.spec.engine_config, self.server.max_queue_len, self.disagg, self.cluster,
                             self.admission)
        lora = entry.spec.engine_config.lora
        static = set(lora.modules) if lora is not None else set()
        # adapters loaded while serving, given to the engines as they come up (AdapterChanges)
        engine.adapters.loaded = {a: path for a, (model, path) in self.adapters.items()
                                  if model == entry.spec.name and (a, path) not in static}
        metrics = entry.metrics
        for hooks, hook in ((engine.on_output, metrics.observe_output), (engine.on_stats, metrics.observe_stats),
                            (engine.on_place, metrics.observe_placement),
                            (engine.on_migrate, metrics.observe_migration),
                            (engine.on_resume, metrics.migration_resume.observe),
                            (engine.on_first_token, metrics.observe_prediction),
                            (engine.on_engine_down, metrics.engine_down)):
            hooks.append(hook)
        if entry.tracer is not None:
            engine.on_output.append(entry.tracer.observe_output)
        return engine

    async def _make_room(self, keep: ModelEntry) -> None:
        while len([e for e in self.loaded() if e is not keep]) >= self.limits.models_max:
            victim = min((e for e in self.loaded() if e is not keep), key=lambda e: e.last_used)
            logger.info("unloading model %s (least recently used) to load %s within --models-max %d",
                        victim.spec.name, keep.spec.name, self.limits.models_max)
            await self._unload(victim, "unloaded", "models_max")

    async def unload(self, name: str) -> None:
        """POST /models/unload: end a loaded model's engines once its requests finish."""
        entry = self.entry(name)
        async with self.lock:
            if entry.state != "loaded":
                raise APIError(400, f"the model `{name}` is not loaded (it is {entry.state})", param="model",
                               code="model_not_loaded")
            await self._unload(entry, "unloaded", "request")

    async def _unload(self, entry: ModelEntry, state: str, reason: str) -> None:
        """New requests wait (and load it again); those in flight get --shutdown-timeout to end."""
        served = entry.served
        self._set_state(entry, "unloading")
        deadline = time.monotonic() + self.server.shutdown_timeout
        while served.busy and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if served.busy:
            logger.warning("model %s: ending %d requests still running to unload it", entry.spec.name,
                           served.engine.num_unfinished)
        entry.freed_bytes = served.resident_bytes()
        names = [c.name for c in served.engine.clients]
        await served.engine.shutdown()
        for engine_name in names:
            entry.metrics.engine_down(engine_name)
        entry.served = None
        self._set_state(entry, state)
        self.unloads.labels(entry.spec.name, reason).inc()
        logger.info("model %s %s (%s): its engines ended, %.0f MiB freed", entry.spec.name, state, reason,
                    entry.freed_bytes / 2**20)

    async def _sleep_idle(self, idle_s: float) -> None:
        """Put to sleep each loaded model that served nothing for ``idle_s`` seconds."""
        while not self.stopping:
            await asyncio.sleep(min(1.0, idle_s / 4))
            now = time.monotonic()
            for entry in self.loaded():
                if entry.served.busy:
                    entry.last_used = now
                elif entry.state == "loaded" and now - entry.last_used >= idle_s and not self.lock.locked():
                    async with self.lock:
                        if entry.state == "loaded" and not entry.served.busy:
                            await self._unload(entry, "sleeping", "idle")

    # ---- LoRA adapters while serving (vLLM's /v1/load_lora_adapter, /v1/unload_lora_adapter) --------

    async def load_adapter(self, name: str, path: str, model: str | None = None, replace: bool = False) -> None:
        if not MODEL_NAME.fullmatch(name) or name in self.entries:
            raise APIError(400, f"{name!r} cannot name an adapter: a name of letters, digits and . _ : - that no "
                           "model has", param="lora_name")
        if name in self.adapters and not replace:
            raise APIError(400, f"The lora adapter '{name}' has already been loaded (load_inplace: true replaces "
                           "it)", param="lora_name")
        entry = self.entry(model)
        if name in self.adapters and self.adapters[name][0] != entry.spec.name:
            raise APIError(400, f"adapter '{name}' belongs to model `{self.adapters[name][0]}`", param="lora_name")
        if entry.state != "loaded":
            await self.load_for_request(entry)
        try:
            await entry.served.engine.change_adapter(name, path)
        except AdapterChangeError as exc:
            raise APIError(409 if exc.in_use else 400, str(exc), param="lora_path") from None
        self.adapters[name] = (entry.spec.name, path)
        logger.info("LoRA adapter %s loaded on %s from %s", name, entry.spec.name, path)

    async def unload_adapter(self, name: str) -> None:
        """New requests for it are refused at once; those in flight get --shutdown-timeout to
        end, else 409 and it stays."""
        if name not in self.adapters or name in self.unloading:
            raise APIError(404, f"The lora adapter '{name}' cannot be found.", param="lora_name")
        entry = self.entries[self.adapters[name][0]]
        self.unloading.add(name)
        try:
            if entry.served is not None:
                view = entry.served.surfaces.get(name)
                deadline = time.monotonic() + self.server.shutdown_timeout
                while view is not None and (view.engine.waiting or view.engine.running) and (
                        time.monotonic() < deadline):
                    await asyncio.sleep(0.05)
                if view is not None and (view.engine.waiting or view.engine.running):
                    raise APIError(409, f"LoRA adapter '{name}' still has requests after --shutdown-timeout "
                                   f"({self.server.shutdown_timeout:g}s): it stays loaded", param="lora_name")
                try:
                    await entry.served.engine.change_adapter(name, None)
                except AdapterChangeError as exc:
                    raise APIError(409 if exc.in_use else 400, str(exc), param="lora_name") from None
                entry.served.surfaces.pop(name, None)
            del self.adapters[name]
        finally:
            self.unloading.discard(name)
        logger.info("LoRA adapter %s unloaded", name)

    def observe_adapters(self) -> None:
        """The adapters' gauges as they are now (at each scrape)."""
        counts = {name: (view.engine.waiting, view.engine.running) for entry in self.loaded()
                  for name, view in entry.served.surfaces.items() if name is not None}
        self.lora_requests.clear()
        for name in self.adapters:
            waiting, running = counts.get(name, (0, 0))
            self.lora_requests.labels(name, "waiting").set(waiting)
            self.lora_requests.labels(name, "running").set(running)
        max_lora = max((e.spec.engine_config.lora.max_loras for e in self.entries.values()
                        if e.spec.engine_config.lora is not None), default=0)
        self.lora_info.clear()
        if max_lora:
            self.lora_info.labels(",".join(n for n, (_, r) in counts.items() if r),
                                  ",".join(n for n, (w, _) in counts.items() if w), str(max_lora)).set(time.time())

    # ---- shutdown (what ``DrainingServer`` calls) ---------------------------------------------

    def stop_relaunching(self) -> None:
        for entry in self.loaded():
            entry.served.engine.stop_relaunching()

    def begin_drain(self, timeout: float) -> None:
        self.stopping = True
        for entry in self.loaded():
            entry.served.engine.begin_drain(timeout)

    async def shutdown(self) -> None:
        self.stopping = True
        if self._watcher is not None:
            self._watcher.cancel()
        engines = [e.served.engine for e in self.loaded()] + [e.starting for e in self.entries.values()
                                                               if e.starting is not None]
        await asyncio.gather(*(engine.shutdown() for engine in engines))
        for entry in self.entries.values():
            if entry.tracer is not None:
                entry.tracer.shutdown()

    # ---- what the server reports ----------------------------------------------------------

    def describe(self, entry: ModelEntry) -> dict:
        """A model as /v1/models lists it (llama.cpp's router gives ``status.value`` too)."""
        engine = entry.served.engine if entry.served is not None else None
        about = {"id": entry.spec.name, "object": "model", "created": int(time.time()), "owned_by": "duoserve",
                 "max_model_len": engine.max_model_len if engine is not None else None,
                 "status": {"value": entry.state}}
        if entry.error is not None:
            about["status"]["error"] = entry.error
        return about

    def describe_adapters(self) -> list[dict]:
        """Each LoRA adapter as vLLM lists it: its base model as ``parent``, its files as ``root``."""
        return [{"id": adapter, "object": "model", "created": int(time.time()), "owned_by": "duoserve",
                 "root": path, "parent": model, "status": {"value": self.entries[model].state}}
                for adapter, (model, path) in self.adapters.items()]


class _ModelsCollector:
    """Every model's metrics in one exposition: the same series of each model's own registry,
    labelled by ``model_name`` where there are several (one model's stay as they always were)."""

    def __init__(self, registry: ModelRegistry) -> None:
        self.registry = registry

    def collect(self) -> list[Metric]:
        families: dict[str, Metric] = {}
        for name, entry in self.registry.entries.items():
            for family in entry.metrics.registry.collect():
                merged = families.get(family.name)
                if merged is None:
                    merged = families[family.name] = Metric(family.name, family.documentation, family.type,
                                                            family.unit)
                for sample in family.samples:
                    labels = sample.labels
                    if not self.registry.single and "model_name" not in labels and family.name not in SERVER_WIDE:
                        labels = {"model_name": name, **labels}
                    merged.samples.append(sample._replace(labels=labels))
        return list(families.values())

