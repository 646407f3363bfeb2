"""AsyncEngine: what the API server calls. ``generate()`` is an async stream of RequestOutputs.

A request goes down one way and its outputs come up the other::

    generate() --> InputProcessor (Request, RequestState) --> EngineGroup --> EngineClient
    queue <-- OutputProcessor (ProcessedOutputs) <-- engine_outputs() <-- EngineSupervisor

``AsyncEngine`` is the only object that talks to the ``EngineGroup``: it adds and aborts
requests there, and passes on what the output processor returns (samples ended on a stop
string, requests to release). The ``EngineSupervisor`` starts the engines, reads their
outputs, and brings a dead engine back; it reports up through ``engine_up``,
``engine_outputs``, ``engine_down`` and ``engines_lost``. A request whose consumer goes
away (client disconnect, cancellation) is aborted in the engines. When an engine dies,
the requests it held get an error instead of hanging, while the others serve on. Once
shutdown has begun nothing is relaunched; requests still running when the drain
deadline passes end with an error saying the server is shutting down.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable

from duoserve.config import ClusterConfig, DisaggConfig, EngineConfig
from duoserve.core.outputs import EngineCoreOutput
from duoserve.errors import DuoserveError
from duoserve.frontend.engine_client import EngineClient, EngineDeadError, new_frontend_id
from duoserve.frontend.frontend import tell_engines
from duoserve.frontend.input_processor import InputProcessor
from duoserve.frontend.launcher import plan_deployment
from duoserve.frontend.output_processor import OutputProcessor
from duoserve.frontend.router import EngineGroup, Router
from duoserve.frontend.supervisor import EngineSupervisor, call_hooks
from duoserve.messages import EngineStats
from duoserve.outputs import RequestOutput
from duoserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineUnavailableError(DuoserveError):
    """The engine is not running (dead, or not started)."""


class ServerShuttingDownError(EngineUnavailableError):
    """The drain deadline passed while the request was still running."""


class QueueFullError(DuoserveError):
    """``max_queue_len`` requests are already in flight."""


class AsyncEngine:
    """The engines of one deployment (``duoserve.frontend.launcher``) behind one request API."""

    def __init__(self, config: EngineConfig, max_queue_len: int | None = None,
                 disagg: DisaggConfig | None = None, cluster: ClusterConfig | None = None) -> None:
        self.config = config
        self.max_queue_len = max_queue_len
        self.disagg = disagg
        self.frontend_id = new_frontend_id()   # engines keep this frontend's requests apart from others'
        decode, prefill = plan_deployment(config, disagg, cluster, self.frontend_id)
        self.supervisor = EngineSupervisor(decode, prefill, self)
        self.group: EngineGroup | None = None        # once the first decode engine is up
        self.inputs: InputProcessor | None = None    # likewise (it needs the engines' tokenizer)
        self.outputs = OutputProcessor()
        self.queues: dict[str, asyncio.Queue] = {}
        self.dead_reason: str | None = None
        self.on_output: list[Callable[[RequestOutput], None]] = []   # metrics hooks
        self.on_place: list[Callable[[str, str | None, str], None]] = []
        self.on_stats = self.supervisor.on_stats                      # (name, instance id, stats)
        self.on_engine_down = self.supervisor.on_engine_down
        self._tasks: list[asyncio.Task] = []
        self._started = False

    async def start(self, wait: bool = True) -> None:
        """Start the engines this frontend launches or places (a failure is raised) and connect
        to the others; with ``wait``, return once every engine is up, else at once."""
        if self._started:
            return
        self._started = True
        await self.supervisor.start()
        while wait and not self.ready:
            if self.supervisor.refused:
                raise EngineDeadError("; ".join(self.supervisor.refused.values()))
            await asyncio.sleep(0.05)

    # ---- state --------------------------------------------------------------------------

    @property
    def clients(self) -> list[EngineClient]:
        return self.supervisor.clients

    @property
    def decode_clients(self) -> list[EngineClient]:
        return self.supervisor.decode_clients

    @property
    def prefill_clients(self) -> list[EngineClient]:
        return self.supervisor.prefill_clients

    @property
    def stats(self) -> dict[str, EngineStats]:
        return self.supervisor.stats

    @property
    def stopping(self) -> bool:
        return self.supervisor.stopping

    @property
    def ready(self) -> bool:
        """Every engine is up (what /health reports)."""
        return self.accepting and self.supervisor.all_up()

    @property
    def accepting(self) -> bool:
        """Requests can be served: a decode (or colocated) engine is up."""
        return (self.group is not None and self.dead_reason is None and not self.stopping
                and self.supervisor.decode_up())

    def not_ready_reason(self) -> str:
        if self.dead_reason:
            return self.dead_reason
        if self.stopping:
            return "the server is shutting down"
        return self.supervisor.waiting_reason()

    @property
    def tokenizer(self):
        return None if self.group is None else self.group.tokenizer

    @property
    def max_model_len(self) -> int | None:
        return None if self.group is None else self.group.max_model_len

    @property
    def vocab_size(self) -> int | None:
        return None if self.group is None else self.group.vocab_size

    @property
    def num_unfinished(self) -> int:
        return len(self.outputs)

    # ---- requests: down to the engines --------------------------------------------------

    async def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str,
                       strict_length: bool = True) -> AsyncIterator[RequestOutput]:
        """Stream snapshots of one request until it finishes; aborts it if the caller stops listening."""
        if not self.accepting:
            raise EngineUnavailableError(self.not_ready_reason())
        if self.max_queue_len is not None and len(self.outputs) >= self.max_queue_len:
            raise QueueFullError(f"the server is full ({len(self.outputs)} requests in flight, "
                                 f"--max-queue-len {self.max_queue_len}); retry shortly")
        queue: asyncio.Queue = asyncio.Queue()
        self.queues[request_id] = queue
        finished = False
        try:
            self._add_request(prompt, params, request_id, strict_length)
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
            if not finished:
                self._abort(request_id)

    def _add_request(self, prompt: str | list[int], params: SamplingParams, request_id: str,
                     strict_length: bool) -> None:
        max_model_len = self.group.max_model_len
        text, prompt_ids = self.inputs.validate(prompt, params, max_model_len, strict_length)
        self.outputs.check_unused(request_id)
        request, state = self.inputs.build(request_id, text, prompt_ids, params, max_model_len)
        self.group.add_request(request)
        self.outputs.add_request(state)   # only once an engine took it: a refusal leaves nothing behind

    def _abort(self, request_id: str) -> None:
        if request_id in self.outputs:
            self.group.abort(request_id)
            self.outputs.abort(request_id)
            self.group.release(request_id)

    def _fail_requests(self, request_ids: Iterable[str], error: Exception) -> None:
        for request_id in request_ids:
            queue = self.queues.get(request_id)
            if queue is not None:
                queue.put_nowait(error)
            self._abort(request_id)

    # ---- what the supervisor reports: up from the engines -------------------------------

    def engine_up(self, client: EngineClient) -> None:
        if self.group is None and client in self.decode_clients:
            router = None if self.disagg is None else Router(self.disagg.prefill_device, self.disagg.max_prefill_len)
            self.group = EngineGroup(self.decode_clients, self.prefill_clients, router)
            self.group.on_place = self.on_place
            self.inputs = InputProcessor(self.group.tokenizer, self.group.vocab_size, self.group.eos_token_ids)
            # The tokenizer and the server's modules are long-lived (~80k objects, 30-40 ms to
            # scan here): moved out of the collector's sight, a full collection while serving
            # scans only the requests' objects instead of stalling every stream that long.
            gc.collect()
            gc.freeze()
        elif self.group is not None:
            self.group.engine_up(client)

    def engine_outputs(self, client: EngineClient, outputs: list[EngineCoreOutput]) -> None:
        """A batch from ``client``: to text, to the engines what it ended, to each request's queue."""
        try:
            self.group.note_outputs(client, [o.request_id for o in outputs])
            result = self.outputs.process_outputs(outputs)
            tell_engines(self.group, result)
        except Exception as exc:  # a bug here fails this batch's requests, never the reader
            logger.exception("cannot process the outputs of %s", client.name)
            self._fail_requests({o.request_id.partition("/")[0] for o in outputs},
                                EngineUnavailableError(f"internal error while processing outputs: {exc}"))
            return
        for snapshot in result.outputs:
            call_hooks(self.on_output, snapshot)
            queue = self.queues.get(snapshot.request_id)
            if queue is not None:
                queue.put_nowait(snapshot)

    def engine_down(self, client: EngineClient, reason: str) -> None:
        stranded = self.group.stranded_by(client) if self.group is not None else []
        logger.error("%s is down (%s): failing the %d requests it held", client.name, reason, len(stranded))
        self._fail_requests(stranded, EngineUnavailableError(
            f"engine {client.name} went down while this request was on it ({reason}); retry it"))

    def engines_lost(self, reason: str) -> None:
        logger.error("engine unavailable: %s", reason)
        self.dead_reason = reason
        for queue in self.queues.values():
            queue.put_nowait(EngineUnavailableError(reason))

    # ---- shutdown -----------------------------------------------------------------------

    def begin_drain(self, timeout: float) -> None:
        """Shutdown began: take no new requests, relaunch nothing, and end the requests still
        running after ``timeout`` seconds with an error (streams get a final event)."""
        if self.stopping:
            return
        self.supervisor.begin_stop()
        logger.info("draining: %d requests in flight get %.0fs to finish", len(self.outputs), timeout)

        async def deadline() -> None:
            await asyncio.sleep(timeout)
            if self.queues:
                logger.warning("ending %d requests still running at the drain deadline", len(self.queues))
            self._fail_requests(list(self.queues), ServerShuttingDownError(
                "the server is shutting down and this request did not finish within --shutdown-timeout"))

        self._tasks.append(asyncio.create_task(deadline(), name="duoserve-drain-deadline"))

    async def shutdown(self, timeout: float = 10.0) -> None:
        self.supervisor.begin_stop()
        for request_id in list(self.outputs.states):
            self._abort(request_id)
        for task in self._tasks:
            task.cancel()
        start = time.monotonic()
        await self.supervisor.shutdown(timeout)
        logger.info("engine stopped in %.1fs", time.monotonic() - start)
