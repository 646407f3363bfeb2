"""AsyncEngine: what the API server calls. ``generate()`` is an async stream of RequestOutputs.

One task reads the engine process's outputs, turns them into text with the shared
``Frontend`` and routes each snapshot to its request's queue. A request whose
consumer goes away (client disconnect, cancellation) is aborted in the engine.
If the engine dies, every waiting request gets an error instead of hanging.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable

from duoserve.config import EngineConfig
from duoserve.engine.messages import EngineStats
from duoserve.errors import DuoserveError
from duoserve.frontend.engine_client import EngineDeadError, EngineProcessClient
from duoserve.frontend.frontend import Frontend
from duoserve.outputs import RequestOutput
from duoserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineUnavailableError(DuoserveError):
    """The engine is not running (dead, or not started)."""


class QueueFullError(DuoserveError):
    """``max_queue_len`` requests are already in flight."""


class AsyncEngine:
    def __init__(self, config: EngineConfig, max_queue_len: int | None = None) -> None:
        self.config = config
        self.max_queue_len = max_queue_len
        self.client = EngineProcessClient(config)
        self.frontend: Frontend | None = None
        self.queues: dict[str, asyncio.Queue] = {}
        self.stats: EngineStats | None = None
        self.dead_reason: str | None = None
        self.on_output: list[Callable[[RequestOutput], None]] = []   # metrics hooks
        self.on_stats: list[Callable[[EngineStats], None]] = []
        self._reader: asyncio.Task | None = None

    async def start(self) -> None:
        await self.client.start()
        self.frontend = Frontend(self.client)
        self._reader = asyncio.create_task(self._read_outputs(), name="duoserve-output-reader")

    @property
    def ready(self) -> bool:
        return self.frontend is not None and self.dead_reason is None and self.client.is_alive()

    @property
    def tokenizer(self):
        return self.client.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.client.max_model_len

    @property
    def num_unfinished(self) -> int:
        return 0 if self.frontend is None else len(self.frontend.states)

    async def _read_outputs(self) -> None:
        try:
            while True:
                batch = await self.client.recv()
                if batch.stats is not None:
                    self.stats = batch.stats
                    for hook in self.on_stats:
                        hook(batch.stats)
                if not batch.outputs:
                    continue
                for snapshot in self.frontend.process_outputs(batch.outputs):
                    for hook in self.on_output:
                        hook(snapshot)
                    queue = self.queues.get(snapshot.request_id)
                    if queue is not None:
                        queue.put_nowait(snapshot)
        except EngineDeadError as exc:
            self._fail_all(str(exc))
        except asyncio.CancelledError:
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
        if not self.ready:
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

    def tokenize_prompt(self, prompt: str | list[int]) -> list[int]:
        return self.frontend.tokenize_prompt(prompt)[1]

    async def shutdown(self, timeout: float = 10.0) -> None:
        if self.frontend is not None:
            for request_id in list(self.frontend.states):
                self.frontend.abort(request_id)
        if self._reader is not None:
            self._reader.cancel()
        start = time.monotonic()
        await self.client.shutdown(timeout)
        logger.info("engine stopped in %.1fs", time.monotonic() - start)
