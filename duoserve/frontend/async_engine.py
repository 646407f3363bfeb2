"""AsyncEngine: what the API server calls. ``generate()`` is an async stream of RequestOutputs.

One task per engine connects to it (engines this frontend launches are started first and
must come up; engines that run elsewhere are waited for in the background, logged, and
retried for as long as it takes), reads its outputs, turns them into text with the shared
``Frontend`` and routes each snapshot to its request's queue. A request whose consumer
goes away (client disconnect, cancellation) is aborted in the engines. When an engine
dies, the requests it held get an error instead of hanging, and it is relaunched (or
reconnected, if it runs elsewhere) while the others serve on. Once shutdown has begun
nothing is relaunched; requests still running when the drain deadline passes end with
an error saying the server is shutting down.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import AsyncIterator, Callable

from duoserve.config import ClusterConfig, DisaggConfig, EngineConfig
from duoserve.errors import DuoserveError
from duoserve.frontend.engine_client import EngineClient, EngineDeadError, new_frontend_id
from duoserve.frontend.frontend import Frontend
from duoserve.frontend.launcher import plan_engines
from duoserve.frontend.router import EngineGroup, Router, model_difference
from duoserve.messages import EngineStats
from duoserve.outputs import RequestOutput
from duoserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
RESTART_ATTEMPTS = 3       # a launched engine that fails this many relaunches in a row stays down
REMOTE_WAIT_S = 10.0       # a remote engine is asked again (and logged) this often until it answers


class EngineUnavailableError(DuoserveError):
    """The engine is not running (dead, or not started)."""


class ServerShuttingDownError(EngineUnavailableError):
    """The drain deadline passed while the request was still running."""


class QueueFullError(DuoserveError):
    """``max_queue_len`` requests are already in flight."""


def _call_hooks(hooks: list[Callable], *args) -> None:
    """Metrics and logging hooks: an error in one is logged, never passed on to the serving path."""
    for hook in hooks:
        try:
            hook(*args)
        except Exception:
            logger.exception("a metrics hook failed (ignored)")


class AsyncEngine:
    """The engines of one deployment (``duoserve.frontend.launcher``) behind one ``Frontend``."""

    def __init__(self, config: EngineConfig, max_queue_len: int | None = None,
                 disagg: DisaggConfig | None = None, cluster: ClusterConfig | None = None) -> None:
        self.config = config
        self.max_queue_len = max_queue_len
        self.disagg = disagg
        self.frontend_id = new_frontend_id()   # engines keep this frontend's requests apart from others'
        if cluster is not None and cluster.kind == "ray":
            from duoserve.frontend.ray_cluster import plan_ray_engines

            self.decode_clients, self.prefill_clients = plan_ray_engines(config, disagg, cluster, self.frontend_id)
        else:
            self.decode_clients, self.prefill_clients = plan_engines(config, disagg, self.frontend_id)
        self.clients = [*self.prefill_clients, *self.decode_clients]
        self.handle: EngineGroup | None = None
        self.frontend: Frontend | None = None
        self.queues: dict[str, asyncio.Queue] = {}
        self.stats: dict[str, EngineStats] = {}
        self.dead_reason: str | None = None
        self.refused: dict[str, str] = {}     # engine name -> why it was refused (another model)
        self.stopping = False                 # shutdown began: nothing is relaunched any more
        self.on_output: list[Callable[[RequestOutput], None]] = []   # metrics hooks
        self.on_stats: list[Callable[[str, str, EngineStats], None]] = []   # (name, instance id, stats)
        self.on_place: list[Callable[[str, str | None, str], None]] = []
        self.on_engine_down: list[Callable[[str], None]] = []
        self._tasks: list[asyncio.Task] = []
        self._started = False

    # ---- start --------------------------------------------------------------------------

    async def start(self, wait: bool = True) -> None:
        """Start the engines this frontend launches or places (a failure is raised) and connect
        to the others; with ``wait``, return once every engine is up, else at once."""
        if self._started:
            return
        self._started = True
        launched = [c for c in self.clients if c.managed]
        try:
            await asyncio.gather(*(client.start() for client in launched))
            for client in launched:
                self._check_model(client)
                self._engine_up(client)
        except BaseException:
            await asyncio.gather(*(client.shutdown() for client in self.clients), return_exceptions=True)
            raise
        self._tasks = [asyncio.create_task(self._serve_engine(c), name=f"duoserve-engine-{c.name}")
                       for c in self.clients]
        while wait and not self.ready:
            if self.refused:
                raise EngineDeadError("; ".join(self.refused.values()))
            await asyncio.sleep(0.05)

    def _check_model(self, client: EngineClient) -> None:
        """Every engine must serve the model the first one serves (they exchange KV)."""
        for other in self.clients:
            if other is not client and other.ready is not None:
                difference = model_difference(other, client)
                if difference is not None:
                    raise EngineDeadError(f"{other.name} and {client.name} serve different models ({difference})")

    def _engine_up(self, client: EngineClient) -> None:
        if self.handle is None and client in self.decode_clients:
            router = None if self.disagg is None else Router(self.disagg.prefill_device, self.disagg.max_prefill_len)
            self.handle = EngineGroup(self.decode_clients, self.prefill_clients, router)
            self.handle.on_place = self.on_place
            self.frontend = Frontend(self.handle)
            # The tokenizer and the server's modules are long-lived (~80k objects, 30-40 ms to
            # scan here): moved out of the collector's sight, a full collection while serving
            # scans only the requests' objects instead of stalling every stream that long.
            gc.collect()
            gc.freeze()
        elif self.handle is not None:
            self.handle.engine_up(client)
        if client in self.decode_clients:
            self._refresh_peers()

    def _refresh_peers(self) -> None:
        """A decode engine came (back) up, maybe at another address: prefill engines hear of it."""
        for prefill in self.prefill_clients:
            peers = prefill.current_peers()
            if peers != prefill.peers and prefill.is_up():
                logger.info("%s hands KV to %s from now on", prefill.name,
                            ", ".join(f"{n} at {a}" for n, a in peers.items()))
                try:
                    prefill.tell_peers(peers)
                except EngineDeadError:   # it went down meanwhile: it gets the peers when it comes back
                    pass

    # ---- state --------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        """Every engine is up (what /health reports)."""
        return self.accepting and all(c.is_up() for c in self.clients)

    @property
    def accepting(self) -> bool:
        """Requests can be served: a decode (or colocated) engine is up; without a prefill
        engine the decode engines prefill themselves."""
        return (self.frontend is not None and self.dead_reason is None and not self.stopping
                and any(c.is_up() for c in self.decode_clients))

    def not_ready_reason(self) -> str:
        if self.dead_reason:
            return self.dead_reason
        if self.stopping:
            return "the server is shutting down"
        waiting = [f"{c.name} at {c.address}" + (f" (refused: {self.refused[c.name]})" if c.name in self.refused else "")
                   for c in self.clients if not c.is_up()]
        return "waiting for " + ", ".join(waiting) if waiting else "starting"

    @property
    def tokenizer(self):
        return None if self.handle is None else self.handle.tokenizer

    @property
    def max_model_len(self) -> int | None:
        return None if self.handle is None else self.handle.max_model_len

    @property
    def num_unfinished(self) -> int:
        return 0 if self.frontend is None else len(self.frontend.states)

    # ---- one task per engine ------------------------------------------------------------

    async def _serve_engine(self, client: EngineClient) -> None:
        """Connect (engines that run elsewhere), read outputs until the engine dies, fail what
        it held and bring it back; until shutdown."""
        if not client.is_up() and not await self._bring_back(client):
            return
        while not self.stopping:
            try:
                self._check_model(client)
            except EngineDeadError as exc:
                logger.error("refusing %s: %s", client.name, exc)
                self.refused[client.name] = str(exc)
                await client.shutdown()
                return
            self.refused.pop(client.name, None)
            self._engine_up(client)
            try:
                await self._read_until_dead(client)
                return
            except EngineDeadError as exc:
                if self.stopping:
                    return
                self._engine_down(client, str(exc))
            if not await self._bring_back(client):
                if not any(c.is_up() for c in self.decode_clients):
                    self._fail_all(f"{client.name} died and could not be restarted")
                return

    def _engine_down(self, client: EngineClient, reason: str) -> None:
        self.stats.pop(client.name, None)
        _call_hooks(self.on_engine_down, client.name)
        stranded = self.handle.stranded_by(client) if self.handle is not None else []
        logger.error("%s is down (%s): failing the %d requests it held", client.name, reason, len(stranded))
        for request_id in stranded:
            queue = self.queues.get(request_id)
            if queue is not None:
                queue.put_nowait(EngineUnavailableError(
                    f"engine {client.name} went down while this request was on it ({reason}); retry it"))
            self.frontend.abort(request_id)

    async def _bring_back(self, client: EngineClient) -> bool:
        """Relaunch a launched engine (a few tries), or wait for a remote one for as long as it takes."""
        attempt = 0
        while not self.stopping:
            attempt += 1
            if not client.launched:
                logger.info("waiting for %s at %s", client.name, client.address)
            try:
                await client.restart(timeout=300.0 if client.launched else REMOTE_WAIT_S)
            except EngineDeadError as exc:
                if client.launched:
                    logger.error("bringing back %s failed (attempt %d): %s", client.name, attempt, exc)
                else:
                    logger.info("%s does not answer yet: %s", client.name, exc)
            else:
                logger.info("%s is up (%s)", client.name, "relaunched" if client.launched else "connected")
                return not self.stopping
            if client.launched and attempt >= RESTART_ATTEMPTS:
                return False
            await asyncio.sleep(min(2.0 * attempt, 10.0) if client.launched else 1.0)
        return False

    async def _read_until_dead(self, client: EngineClient) -> None:
        instance_id = client.ready.instance_id
        while True:
            batch = await client.recv()
            if batch.stats is not None:
                self.stats[client.name] = batch.stats
                _call_hooks(self.on_stats, client.name, instance_id, batch.stats)
            if not batch.outputs:
                continue
            try:
                self.handle.note_outputs(client, (o.request_id for o in batch.outputs))
                snapshots = self.frontend.process_outputs(batch.outputs)
            except Exception as exc:  # a bug here fails this batch's requests, never the reader
                logger.exception("cannot process the outputs of %s", client.name)
                self._fail_requests({o.request_id.partition("/")[0] for o in batch.outputs},
                                    EngineUnavailableError(f"internal error while processing outputs: {exc}"))
                continue
            for snapshot in snapshots:
                _call_hooks(self.on_output, snapshot)
                queue = self.queues.get(snapshot.request_id)
                if queue is not None:
                    queue.put_nowait(snapshot)

    def _fail_requests(self, request_ids, error: Exception) -> None:
        for request_id in request_ids:
            queue = self.queues.get(request_id)
            if queue is not None:
                queue.put_nowait(error)
            if self.frontend is not None:
                self.frontend.abort(request_id)

    def _fail_all(self, reason: str) -> None:
        logger.error("engine unavailable: %s", reason)
        self.dead_reason = reason
        for queue in self.queues.values():
            queue.put_nowait(EngineUnavailableError(reason))

    # ---- requests -----------------------------------------------------------------------

    async def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str,
                       strict_length: bool = True) -> AsyncIterator[RequestOutput]:
        """Stream snapshots of one request until it finishes; aborts it if the caller stops listening."""
        if not self.accepting:
            raise EngineUnavailableError(self.not_ready_reason())
        if self.max_queue_len is not None and self.num_unfinished >= self.max_queue_len:
            raise QueueFullError(f"the server is full ({self.num_unfinished} requests in flight, "
                                 f"--max-queue-len {self.max_queue_len}); retry shortly")
        queue: asyncio.Queue = asyncio.Queue()
        self.queues[request_id] = queue
        finished = False
        try:
            self.frontend.add_request(prompt, params, request_id, strict_length=strict_length)
            while True:
                item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self.queues.pop(request_id, None)
            if not finished and self.frontend is not None and request_id in self.frontend.states:
                self.frontend.abort(request_id)

    # ---- shutdown -----------------------------------------------------------------------

    def begin_drain(self, timeout: float) -> None:
        """Shutdown began: take no new requests, relaunch nothing, and end the requests still
        running after ``timeout`` seconds with an error (streams get a final event)."""
        if self.stopping:
            return
        self.stopping = True
        logger.info("draining: %d requests in flight get %.0fs to finish", self.num_unfinished, timeout)

        async def deadline() -> None:
            await asyncio.sleep(timeout)
            if self.queues:
                logger.warning("ending %d requests still running at the drain deadline", len(self.queues))
            self._fail_requests(list(self.queues), ServerShuttingDownError(
                "the server is shutting down and this request did not finish within --shutdown-timeout"))

        self._tasks.append(asyncio.create_task(deadline(), name="duoserve-drain-deadline"))

    async def shutdown(self, timeout: float = 10.0) -> None:
        self.stopping = True
        if self.frontend is not None:
            for request_id in list(self.frontend.states):
                self.frontend.abort(request_id)
        for task in self._tasks:
            task.cancel()
        start = time.monotonic()
        await asyncio.gather(*(client.shutdown(timeout) for client in self.clients))
        logger.info("engine stopped in %.1fs", time.monotonic() - start)
