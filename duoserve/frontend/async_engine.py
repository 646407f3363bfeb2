"""AsyncEngine: what the API server calls. ``generate()`` is an async stream of RequestOutputs.

A request goes down one way and its outputs come up the other::

    generate() --> InputProcessor (Request, RequestState) --> EngineGroup --> EngineClient
    queue <-- OutputProcessor (ProcessedOutputs) <-- engine_outputs() <-- EngineSupervisor

``AsyncEngine`` is the only object that talks to the ``EngineGroup``: it adds and aborts
requests there, and passes on what the output processor returns (samples ended on a stop
string, requests to release). The ``EngineSupervisor`` starts the engines, reads their
outputs, and brings a dead engine back; it reports up through ``engine_up``,
``engine_outputs``, ``engine_down`` and ``engines_lost``. A request whose consumer goes
away (client disconnect, cancellation) is aborted in the engines.

When an engine goes down (its process exits, it reports a failure, or its connection is
lost), the requests it held migrate: each goes on on a decode engine that is up, from the
tokens its stream has already sent (``EngineGroup.migrate``), and its client sees neither
an error nor a repeated or missing token. Greedy continuations are the undisturbed run's,
and seeded ones too (a seeded draw depends on the seed and the token's position, not on
the engine). With no decode engine up a request waits for one to come (back) up, at most
``MIGRATION_WAIT_S`` seconds; a request that loses an engine after ``MAX_MIGRATIONS``
moves, or waits too long, ends with an error naming the engines. Once shutdown has begun nothing is relaunched;
requests still running when the drain deadline passes end with an error saying the server
is shutting down.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import time
from collections.abc import AsyncIterator, Callable, Iterable

from duoserve.config import ClusterConfig, DisaggConfig, EngineConfig
from duoserve.core.outputs import EngineCoreOutput
from duoserve.core.scheduler import QUEUE_TIMEOUT
from duoserve.errors import ConfigError, DuoserveError, InvalidInputError
from duoserve.frontend.adapters import AdapterChanges
from duoserve.frontend.admission import Admission, QueueFullError, QueueTimeoutError
from duoserve.frontend.engine_client import EngineClient, EngineDeadError, new_frontend_id, process_running
from duoserve.frontend.frontend import tell_engines
from duoserve.frontend.input_processor import InputProcessor
from duoserve.frontend.launcher import plan_deployment, signal_engine
from duoserve.frontend.output_processor import OutputProcessor
from duoserve.frontend.router import EngineGroup, Router
from duoserve.frontend.supervisor import EngineSupervisor, call_hooks
from duoserve.messages import EngineStats
from duoserve.outputs import RequestOutput
from duoserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
MAX_MIGRATIONS = 3        # a request is moved at most this many times (the next lost engine fails it)
MIGRATION_WAIT_S = 120.0  # how long a request waits for a decode engine to come (back) up


def migration_cause(client: EngineClient, reason: str) -> str:
    """What an engine's going down is counted as: it reported a failure, its process exited,
    or it could not be reached (its connection dropped or its heartbeats went unanswered while
    its process, if launched here, lives on: frozen, or on a host cut off)."""
    if reason.startswith(f"{client.name} failed:"):
        return "failed"
    if client.launched and client.process is not None and not process_running(client.process):
        return "exited"
    return "unreachable"


def ended_unseen(state, eos_token_ids: tuple[int, ...], max_total_tokens: int | None) -> list[EngineCoreOutput]:
    """The samples of ``state`` that had ended on the engine that went down, their last output
    lost with it: the finishing outputs it would have sent (a stop token last, max_tokens, or
    the context full)."""
    params, ended = state.params, []
    for index, output in enumerate(state.outputs):
        if output.finished or not output.token_ids:
            continue
        last, count = output.token_ids[-1], len(output.token_ids)
        reason = stop = None
        if count >= params.min_tokens and not params.ignore_eos and last in eos_token_ids:
            reason = "stop"
        elif count >= params.min_tokens and last in params.stop_token_ids:
            reason, stop = "stop", last
        elif (params.max_tokens is not None and count >= params.max_tokens) or \
                (max_total_tokens is not None and len(state.prompt_token_ids) + count >= max_total_tokens):
            reason = "length"
        if reason is not None:
            request_id = state.request_id if index == 0 else f"{state.request_id}/{index}"
            ended.append(EngineCoreOutput(request_id, [], position=count, finish_reason=reason, stop_reason=stop))
    return ended


class EngineUnavailableError(DuoserveError):
    """The engine is not running (dead, or not started)."""


class ServerShuttingDownError(EngineUnavailableError):
    """The drain deadline passed while the request was still running."""


# a prompt prefilled on its decode engine may hold up the decodes there for this many prefill
# turns: a short prompt sent to a prefill engine busy with a long one waits seconds instead
STALL_TURNS = 2


class AsyncEngine:
    """The engines of one deployment (``duoserve.frontend.launcher``) behind one request API."""

    def __init__(self, config: EngineConfig, max_queue_len: int | None = None,
                 disagg: DisaggConfig | None = None, cluster: ClusterConfig | None = None,
                 admission: Admission | None = None) -> None:
        self.config = config
        self.max_queue_len = max_queue_len
        self.admission = admission or Admission()   # caps on waiting requests, classes for the metrics
        self.disagg = disagg
        self.frontend_id = new_frontend_id()   # engines keep this frontend's requests apart from others'
        decode, prefill = plan_deployment(config, disagg, cluster, self.frontend_id)
        self.routing = (cluster or ClusterConfig()).routing
        self.supervisor = EngineSupervisor(decode, prefill, self)
        self.group: EngineGroup | None = None        # once the first decode engine is up
        self.inputs: InputProcessor | None = None    # likewise (it needs the engines' tokenizer)
        self.outputs = OutputProcessor()
        self.queues: dict[str, asyncio.Queue] = {}
        self.dead_reason: str | None = None
        self.on_output: list[Callable[[RequestOutput], None]] = []   # metrics hooks
        self.on_place: list[Callable[[str, str | None, str], None]] = []
        self.on_migrate: list[Callable[[str, str, int], None]] = []   # (cause, lost engine, tokens to restore)
        self.on_resume: list[Callable[[float], None]] = []            # seconds from migration to next token
        self.on_first_token: list[Callable[[bool, float, float], None]] = []   # (remote, predicted, measured TTFT)
        self.parked: dict[str, tuple[str, str, str]] = {}   # request -> (lost engine, reason, cause): waiting
        self.on_stats = self.supervisor.on_stats                      # (name, instance id, stats)
        self.on_stats.append(self._cached_blocks)
        self.on_engine_down = self.supervisor.on_engine_down
        self._tasks: list[asyncio.Task] = []
        self.kv_event_feed = None   # --routing kv-events: the engines' KV events, feeding the prefix map
        self.adapters = AdapterChanges()   # LoRA adapters loaded while serving
        self._started = False
        self._draining = False
        self._shut_down = False

    async def start(self, wait: bool = True) -> None:
        """Start the engines this frontend launches or places (a failure is raised) and connect
        to the others; with ``wait``, return once every engine is up, else at once."""
        if self._started:
            return
        self._started = True
        self._start_kv_event_feed()
        await self.supervisor.start()
        while wait and not self.ready:
            if self.supervisor.refused:
                raise EngineDeadError("; ".join(self.supervisor.refused.values()))
            await asyncio.sleep(0.05)

    def _start_kv_event_feed(self) -> None:
        """``--routing kv-events``: the prefix map fed by the engines' KV events."""
        if self.routing != "kv-events":
            return
        endpoints = [c.config.kv_events.endpoint for c in self.clients
                     if c.config is not None and c.config.kv_events is not None]
        if not endpoints:
            raise ConfigError("routing", "kv-events", "prefix routing on KV events needs engines that publish "
                              "them: give --kv-events-endpoint")
        from duoserve.frontend.kv_event_feed import KVEventFeed

        self.kv_event_feed = KVEventFeed(endpoints, lambda: self.group.prefixes if self.group else None)
        self.kv_event_feed.start()

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
    def started(self) -> bool:
        """The engines have been up once: the tokenizer and the model's limits are known."""
        return self.group is not None

    def drain_engine(self, name: str) -> int:
        """SIGTERM a launched engine: it drains (its stats then say so; new work goes elsewhere from
        now), stops once it holds nothing, and the supervisor launches it again. The requests it
        holds now. KeyError: no such engine; ValueError: it runs elsewhere, or is not up."""
        client = next((c for c in self.clients if c.name == name), None)
        if client is None:
            raise KeyError(name)
        if not client.launched:
            raise ValueError(f"{name} runs elsewhere ({client.address}): send it SIGTERM on its host, it drains "
                             "the same way")
        if not client.is_up() or client.draining:
            raise ValueError(f"{name} is not up, or drains already")
        client.draining = True   # before its stats can say so: nothing new goes there from now
        signal_engine(client, signal.SIGTERM)
        return 0 if self.group is None else self.group.load.get(name, 0)

    def slow_engines(self) -> list[str]:
        """Engines silent past the silence timeout while their connection answers (busy, not dead)."""
        return [c.name for c in self.clients if c.slow_since is not None]

    def engine_memory(self) -> dict[str, dict]:
        """Each engine's start-up memory report, by engine name (those that said ready)."""
        return {c.name: c.ready.memory for c in self.clients if c.ready is not None}

    def structured_request_counts(self) -> tuple[int, int]:
        """(requests that asked for structured output, grammars refused) so far."""
        if self.inputs is None:
            return 0, 0
        return self.inputs.num_constrained, self.inputs.num_rejected_grammars

    @property
    def tokenizer(self):
        return None if self.group is None else self.group.tokenizer

    @property
    def declared_pooling(self) -> str | None:
        """How the model file says to pool an embedding (None: it does not say)."""
        return None if self.group is None else self.group.reference.pooling

    @property
    def reranker(self) -> str | None:
        """What kind of reranker the model is ("cross-encoder", "yes-no"), None for none."""
        return None if self.group is None else self.group.reference.reranker

    @property
    def score_template(self) -> str | None:
        """A yes/no reranker's prompt, where its file gives one."""
        return None if self.group is None else self.group.reference.score_template

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
        try:
            self.config.scheduler.check_priority(params.priority)
        except ConfigError as exc:
            raise InvalidInputError(exc.field, str(exc)) from None
        admission = self.admission
        if self.max_queue_len is not None and len(self.outputs) >= self.max_queue_len:
            admission.refused["queue_full"] += 1
            raise QueueFullError(f"the server is full ({len(self.outputs)} requests in flight, "
                                 f"--max-queue-len {self.max_queue_len}); retry shortly",
                                 admission.retry_after(sum(admission.waiting.values())))
        admission.check(params.tenant)
        queue: asyncio.Queue = asyncio.Queue()
        self.queues[request_id] = queue
        admission.enter(request_id, params)
        finished = False
        try:
            self._add_request(prompt, params, request_id, strict_length)
            while True:
                item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                finished = item.finished
                if finished and self._timed_out(item):
                    admission.refused["timeout"] += 1
                    raise QueueTimeoutError(item.outputs[0].error, admission.retry_after(
                        sum(admission.waiting.values())))
                admission.started(request_id)
                yield item
                if finished:
                    return
        finally:
            self.queues.pop(request_id, None)
            admission.leave(request_id)
            if not finished:
                self._abort(request_id)

    def tenant_load(self) -> dict[tuple[str, str], int]:
        """(engine, tenant's metrics label) -> requests the router placed there."""
        counts: dict[tuple[str, str], int] = {}
        for (engine, tenant), n in (self.group.tenant_load() if self.group is not None else {}).items():
            key = (engine, self.admission.label(tenant))
            counts[key] = counts.get(key, 0) + n
        return counts

    def _timed_out(self, item: RequestOutput) -> bool:
        """Dropped by its engine for waiting past its timeout (``params.timeout``), nothing computed."""
        return any(o.error is not None and o.error.startswith(QUEUE_TIMEOUT) for o in item.outputs)

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

    def _cached_blocks(self, name: str, instance_id: str, stats) -> None:
        """An engine's report of its prefix cache, for prefix routing."""
        if stats.cached_blocks is not None and self.group is not None:
            self.group.prefixes.report(name, stats.cached_blocks)

    def _disagg_router(self, max_model_len: int, turns: bool) -> Router:
        prefill, decode = self.disagg.engine_configs(self.config)
        return Router(self.disagg.prefill_device, self.disagg.max_prefill_len, self.routing,
                      decode.scheduler.token_budget(max_model_len), STALL_TURNS * self.disagg.prefill_turn,
                      self.disagg.prefill_turn if turns else 0.0, prefill.scheduler.token_budget(max_model_len))

    def engine_up(self, client: EngineClient) -> None:
        self.adapters.engine_up(client)
        if self.group is None and client in self.decode_clients:
            turns = any(c.config is not None and c.config.turns is not None for c in self.decode_clients)
            router = (Router(routing=self.routing) if self.disagg is None else self._disagg_router(
                client.ready.max_model_len, turns))
            self.group = EngineGroup(self.decode_clients, self.prefill_clients, router)
            self.group.on_place, self.group.on_resume = self.on_place, self.on_resume
            self.group.on_first_token = self.on_first_token
            self.inputs = InputProcessor(self.group.tokenizer, self.group.vocab_size, self.group.eos_token_ids,
                                         self.group.reference.reranker)
            # The tokenizer and the server's modules are long-lived (tens of thousands of
            # objects): moved out of the collector's sight, a full collection while serving
            # scans only the requests' objects instead of stalling every stream for the scan.
            gc.collect()
            gc.freeze()
        elif self.group is not None:
            self.group.engine_up(client)
        if self.parked and client in self.decode_clients:
            for request_id, (lost_on, reason, cause) in list(self.parked.items()):
                self.parked.pop(request_id)
                self._migrate(request_id, lost_on, reason, cause)

    def engine_outputs(self, client: EngineClient, outputs: list[EngineCoreOutput]) -> None:
        """A batch from ``client``: to text, to the engines what it ended, to each request's queue."""
        outputs = self.adapters.take_answers(outputs)
        try:
            self._deliver(self.group.note_outputs(client, outputs))
        except Exception as exc:  # a bug here fails this batch's requests, never the reader
            logger.exception("cannot process the outputs of %s", client.name)
            self._fail_requests({o.request_id.partition("/")[0] for o in outputs},
                                EngineUnavailableError(f"internal error while processing outputs: {exc}"))

    def _deliver(self, outputs: list[EngineCoreOutput]) -> None:
        result = self.outputs.process_outputs(outputs)
        tell_engines(self.group, result)
        for snapshot in result.outputs:
            call_hooks(self.on_output, snapshot)
            queue = self.queues.get(snapshot.request_id)
            if queue is not None:
                queue.put_nowait(snapshot)

    def engine_down(self, client: EngineClient, reason: str) -> None:
        stranded = self.group.stranded_by(client) if self.group is not None else []
        logger.error("%s is down (%s): moving the %d requests it held", client.name, reason, len(stranded))
        cause = migration_cause(client, reason)
        for request_id in stranded:
            self._migrate(request_id, client.name, reason, cause)

    def _migrate(self, request_id: str, lost_on: str, reason: str, cause: str) -> None:
        """Go on with a request whose engine ``lost_on`` went down (see the module docstring)."""
        state = self.outputs.states.get(request_id)
        placement = self.group.placements.get(request_id)
        if state is None or placement is None:
            return
        lost = [*placement.lost_on, lost_on]
        if len(lost) > MAX_MIGRATIONS:
            self._fail_requests([request_id], EngineUnavailableError(
                f"engine {lost_on} went down while this request was on it ({reason}); it had already lost "
                f"{', '.join(placement.lost_on)}, and is not moved again; retry it"))
            return
        self._deliver(ended_unseen(state, self.group.eos_token_ids, placement.request.max_total_tokens))
        if request_id not in self.outputs.states:   # its last token had come: it ended now
            return
        resumed = {i: list(o.token_ids) for i, o in enumerate(state.outputs) if not o.finished}
        if not any(resumed.values()) and not any(o.finished for o in state.outputs):
            resumed = {}                              # no token yet: it starts over, placed anew
        try:
            decode = self.group.migrate(request_id, resumed, lost_on)
        except EngineDeadError:
            self._park(request_id, lost_on, reason, cause)
            return
        num_tokens = len(state.prompt_token_ids) + max((len(t) for t in resumed.values()), default=0)
        logger.info("request %s moved from %s to %s (%d tokens to restore)", request_id, lost_on, decode, num_tokens)
        call_hooks(self.on_migrate, cause, lost_on, num_tokens)

    def _park(self, request_id: str, lost_on: str, reason: str, cause: str) -> None:
        """No decode engine is up: wait for one (``engine_up``), at most MIGRATION_WAIT_S."""
        self.parked[request_id] = (lost_on, reason, cause)

        def give_up() -> None:
            if self.parked.pop(request_id, None) is not None:
                self._fail_requests([request_id], EngineUnavailableError(
                    f"engine {lost_on} went down while this request was on it ({reason}) and no decode engine "
                    f"came up within {MIGRATION_WAIT_S:.0f}s; retry it"))

        asyncio.get_running_loop().call_later(MIGRATION_WAIT_S, give_up)

    def engines_lost(self, reason: str) -> None:
        logger.error("engine unavailable: %s", reason)
        self.dead_reason = reason
        self.parked.clear()
        for queue in self.queues.values():
            queue.put_nowait(EngineUnavailableError(reason))

    async def change_adapter(self, name: str, path: str | None) -> None:
        """Load (path) or unload (None) a LoRA adapter on every engine (``AdapterChangeError``)."""
        await self.adapters.change(self.clients, name, path)

    # ---- shutdown -----------------------------------------------------------------------

    def stop_relaunching(self) -> None:
        """A stop signal came (the drain begins at uvicorn's next tick): from now on no engine
        is relaunched; engines the signal reached too may end first (they drain on their own)."""
        self.supervisor.begin_stop()

    def begin_drain(self, timeout: float) -> None:
        """Shutdown began: take no new requests, relaunch nothing, and end the requests still
        running after ``timeout`` seconds with an error (streams get a final event)."""
        if self._draining:
            return
        self._draining = True
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
        """Stop the engines (once: a forced exit calls this after uvicorn skipped the app's
        shutdown, which may have begun it)."""
        if self._shut_down:
            return
        self._shut_down = True
        self.supervisor.begin_stop()
        for request_id in list(self.outputs.states):
            self._abort(request_id)
        for task in self._tasks:
            task.cancel()
        if self.kv_event_feed is not None:
            await self.kv_event_feed.close()
        start = time.monotonic()
        await self.supervisor.shutdown(timeout)
        logger.info("engine stopped in %.1fs", time.monotonic() - start)
