"""AsyncEngine: what the API server calls. ``generate()`` is an async stream of RequestOutputs.

One task reads the engine process's outputs, turns them into text with the shared
``Frontend`` and routes each snapshot to its request's queue. A request whose
consumer goes away (client disconnect, cancellation) is aborted in the engine.
If the engine dies, every waiting request gets an error instead of hanging.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Callable

from duoserve.config import DisaggConfig, EngineConfig
from duoserve.engine.messages import EngineStats
from duoserve.errors import DuoserveError
from duoserve.frontend.engine_client import EngineDeadError, EngineProcessClient
from duoserve.frontend.frontend import Frontend
from duoserve.frontend.router import DisaggregatedEngines, Router, check_same_model
from duoserve.outputs import RequestOutput
from duoserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineUnavailableError(DuoserveError):
    """The engine is not running (dead, or not started)."""


class QueueFullError(DuoserveError):
    """``max_queue_len`` requests are already in flight."""


class AsyncEngine:
    """One colocated engine process, or a prefill and a decode engine process (``disagg``)."""

    def __init__(self, config: EngineConfig, max_queue_len: int | None = None,
                 disagg: DisaggConfig | None = None) -> None:
        self.config = config
        self.max_queue_len = max_queue_len
        self.disagg = disagg
        if disagg is None:
            self.clients = [EngineProcessClient(config)]
        else:
            prefill_config, decode_config = disagg.engine_configs(config)
            handoff = _handoff_addresses(disagg.kv_transport)
            self.clients = [EngineProcessClient(prefill_config, "prefill-0", handoff),
                            EngineProcessClient(decode_config, "decode-0", handoff)]
        self.handle = None
        self.frontend: Frontend | None = None
        self.queues: dict[str, asyncio.Queue] = {}
        self.stats: dict[str, EngineStats] = {}
        self.dead_reason: str | None = None
        self.on_output: list[Callable[[RequestOutput], None]] = []   # metrics hooks
        self.on_stats: list[Callable[[str, EngineStats], None]] = []
        self._readers: list[asyncio.Task] = []

    async def start(self) -> None:
        try:
            await asyncio.gather(*(client.start() for client in self.clients))
            if self.disagg is not None:
                check_same_model(*self.clients)
        except BaseException:
            await asyncio.gather(*(client.shutdown() for client in self.clients), return_exceptions=True)
            raise
        if self.disagg is None:
            self.handle = self.clients[0]
        else:
            router = Router(self.disagg.prefill_device, self.disagg.max_prefill_len)
            self.handle = DisaggregatedEngines(self.clients[0], self.clients[1], router)
        self.frontend = Frontend(self.handle)
        self._readers = [asyncio.create_task(self._read_outputs(c), name=f"duoserve-reader-{c.name}")
                         for c in self.clients]

    @property
    def ready(self) -> bool:
        """Every engine is up (what /health reports)."""
        return self.accepting and all(c.is_up() for c in self.clients)

    @property
    def accepting(self) -> bool:
        """Requests can be served: the decode (or only) engine is up; a missing prefill engine
        only moves prefills onto it."""
        return self.frontend is not None and self.dead_reason is None and self.client.is_up()

    @property
    def client(self) -> EngineProcessClient:
        """The engine that decodes (the only one when colocated)."""
        return self.clients[-1]

    @property
    def tokenizer(self):
        return self.handle.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.handle.max_model_len

    @property
    def num_unfinished(self) -> int:
        return 0 if self.frontend is None else len(self.frontend.states)

    async def _read_outputs(self, client: EngineProcessClient) -> None:
        while True:
            try:
                await self._read_until_dead(client)
                return
            except EngineDeadError as exc:
                if self.disagg is None or client is not self.clients[0]:
                    self._fail_all(str(exc))
                    return
                await self._recover_prefill(client, str(exc))

    async def _recover_prefill(self, client: EngineProcessClient, reason: str) -> None:
        """A dead prefill engine fails only the requests it held; the decode engine prefills
        new ones (the router sees it down) until the restarted one is ready."""
        logger.error("%s died (%s): failing the requests it was prefilling, restarting it", client.name, reason)
        for request_id, placed in list(self.handle.placements.items()):
            if placed == client.name and request_id in self.frontend.states:
                queue = self.queues.get(request_id)
                if queue is not None:
                    queue.put_nowait(EngineUnavailableError(
                        f"the prefill engine died while this request was on it ({reason}); retry it"))
                self.frontend.abort(request_id)
        for attempt in range(1, 4):
            try:
                await client.restart()
                logger.info("%s restarted", client.name)
                return
            except EngineDeadError as exc:
                logger.error("restarting %s failed (attempt %d): %s", client.name, attempt, exc)
                await asyncio.sleep(2.0 * attempt)
        raise EngineDeadError(f"{client.name} could not be restarted")

    async def _read_until_dead(self, client: EngineProcessClient) -> None:
        try:
            while True:
                batch = await client.recv()
                if batch.stats is not None:
                    self.stats[client.name] = batch.stats
                    for hook in self.on_stats:
                        hook(client.name, batch.stats)
                if not batch.outputs:
                    continue
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


def _handoff_addresses(transport: str) -> dict:
    """Where the decode engine takes KV and the prefill engine takes acks, on this host."""
    if transport == "tcp":
        return {"kv_addr": f"tcp://127.0.0.1:{_free_port()}", "ack_addr": f"tcp://127.0.0.1:{_free_port()}",
                "transport": "tcp"}
    base = os.path.join(tempfile.gettempdir(), f"duoserve-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    return {"kv_addr": f"ipc://{base}-kv", "ack_addr": f"ipc://{base}-ack", "transport": "shm"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
