"""AsyncEngine: what the API server calls. ``generate()`` is an async stream of RequestOutputs.

One task per engine reads its outputs, turns them into text with the shared
``Frontend`` and routes each snapshot to its request's queue. A request whose
consumer goes away (client disconnect, cancellation) is aborted in the engines.
When an engine dies, the requests it held get an error instead of hanging, and it
is relaunched (or reconnected, if it runs elsewhere) while the others serve on.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable

from duoserve.config import DisaggConfig, EngineConfig
from duoserve.engine.messages import EngineStats
from duoserve.errors import DuoserveError
from duoserve.frontend.engine_client import EngineClient, EngineDeadError
from duoserve.frontend.frontend import Frontend
from duoserve.frontend.launcher import plan_engines
from duoserve.frontend.router import EngineGroup, Router, check_same_model
from duoserve.outputs import RequestOutput
from duoserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
RESTART_ATTEMPTS = 3   # a launched engine that fails this many relaunches in a row stays down


class EngineUnavailableError(DuoserveError):
    """The engine is not running (dead, or not started)."""


class QueueFullError(DuoserveError):
    """``max_queue_len`` requests are already in flight."""


class AsyncEngine:
    """The engines of one deployment (``duoserve.frontend.launcher``) behind one ``Frontend``."""

    def __init__(self, config: EngineConfig, max_queue_len: int | None = None,
                 disagg: DisaggConfig | None = None) -> None:
        self.config = config
        self.max_queue_len = max_queue_len
        self.disagg = disagg
        self.decode_clients, self.prefill_clients = plan_engines(config, disagg)
        self.clients = [*self.prefill_clients, *self.decode_clients]
        self.handle: EngineGroup | None = None
        self.frontend: Frontend | None = None
        self.queues: dict[str, asyncio.Queue] = {}
        self.stats: dict[str, EngineStats] = {}
        self.dead_reason: str | None = None
        self.on_output: list[Callable[[RequestOutput], None]] = []   # metrics hooks
        self.on_stats: list[Callable[[str, EngineStats], None]] = []
        self.on_place: list[Callable[[str, str | None, str], None]] = []
        self._readers: list[asyncio.Task] = []

    async def start(self) -> None:
        try:
            await asyncio.gather(*(client.start() for client in self.clients))
            check_same_model(self.clients)
        except BaseException:
            await asyncio.gather(*(client.shutdown() for client in self.clients), return_exceptions=True)
            raise
        router = None if self.disagg is None else Router(self.disagg.prefill_device, self.disagg.max_prefill_len)
        self.handle = EngineGroup(self.decode_clients, self.prefill_clients, router)
        self.handle.on_place = self.on_place
        self.frontend = Frontend(self.handle)
        self._readers = [asyncio.create_task(self._read_outputs(c), name=f"duoserve-reader-{c.name}")
                         for c in self.clients]

    @property
    def ready(self) -> bool:
        """Every engine is up (what /health reports)."""
        return self.accepting and all(c.is_up() for c in self.clients)

    @property
    def accepting(self) -> bool:
        """Requests can be served: a decode (or colocated) engine is up; without a prefill
        engine the decode engines prefill themselves."""
        return (self.frontend is not None and self.dead_reason is None
                and any(c.is_up() for c in self.decode_clients))

    @property
    def tokenizer(self):
        return self.handle.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.handle.max_model_len

    @property
    def num_unfinished(self) -> int:
        return 0 if self.frontend is None else len(self.frontend.states)

    async def _read_outputs(self, client: EngineClient) -> None:
        """Read one engine's outputs for as long as it lives; when it dies, fail what it held
        and bring it back (relaunch it, or reconnect once a remote one is running again)."""
        while True:
            try:
                await self._read_until_dead(client)
                return
            except EngineDeadError as exc:
                self._fail_stranded(client, str(exc))
            if not await self._bring_back(client):
                if not any(c.is_up() for c in self.decode_clients):
                    self._fail_all(f"{client.name} died and could not be restarted")
                return

    def _fail_stranded(self, client: EngineClient, reason: str) -> None:
        stranded = self.handle.stranded_by(client)
        logger.error("%s is down (%s): failing the %d requests it held", client.name, reason, len(stranded))
        for request_id in stranded:
            queue = self.queues.get(request_id)
            if queue is not None:
                queue.put_nowait(EngineUnavailableError(
                    f"engine {client.name} went down while this request was on it ({reason}); retry it"))
            self.frontend.abort(request_id)

    async def _bring_back(self, client: EngineClient) -> bool:
        attempt = 0
        while True:
            attempt += 1
            try:
                await client.restart(timeout=300.0 if client.launched else 30.0)
                logger.info("%s is back (%s)", client.name, "relaunched" if client.launched else "reconnected")
                return True
            except EngineDeadError as exc:
                logger.error("bringing back %s failed (attempt %d): %s", client.name, attempt, exc)
            if client.launched and attempt >= RESTART_ATTEMPTS:
                return False
            await asyncio.sleep(min(2.0 * attempt, 10.0))

    async def _read_until_dead(self, client: EngineClient) -> None:
        try:
            while True:
                batch = await client.recv()
                if batch.stats is not None:
                    self.stats[client.name] = batch.stats
                    for hook in self.on_stats:
                        hook(client.name, batch.stats)
                if not batch.outputs:
                    continue
                self.handle.note_outputs(client, (o.request_id for o in batch.outputs))
                for snapshot in self.frontend.process_outputs(batch.outputs):
                    for hook in self.on_output:
                        hook(snapshot)
                    queue = self.queues.get(snapshot.request_id)
                    if queue is not None:
                        queue.put_nowait(snapshot)
        except (EngineDeadError, asyncio.CancelledError):
            raise
        except Exception as exc:  # a bug here must not leave requests hanging
            logger.exception("output reader failed")
            self._fail_all(f"internal error in the output reader: {exc}")

    def _fail_all(self, reason: str) -> None:
        logger.error("engine unavailable: %s", reason)
        self.dead_reason = reason
        for queue in self.queues.values():
            queue.put_nowait(EngineUnavailableError(reason))

    async def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str,
                       strict_length: bool = True) -> AsyncIterator[RequestOutput]:
        """Stream snapshots of one request until it finishes; aborts it if the caller stops listening."""
        if not self.accepting:
            raise EngineUnavailableError(self.dead_reason or "the engine is not ready")
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

    async def shutdown(self, timeout: float = 10.0) -> None:
        if self.frontend is not None:
            for request_id in list(self.frontend.states):
                self.frontend.abort(request_id)
        for reader in self._readers:
            reader.cancel()
        start = time.monotonic()
        await asyncio.gather(*(client.shutdown(timeout) for client in self.clients))
        logger.info("engine stopped in %.1fs", time.monotonic() - start)
