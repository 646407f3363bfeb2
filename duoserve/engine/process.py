"""An EngineCore in its own process, served over one ZeroMQ ROUTER socket.

The engine binds its address (``ipc://`` when the launcher starts it on this host,
``tcp://`` for ``duoserve prefill|decode --listen`` on any host), loads the model and
waits. A frontend connects and says ``Hello``; the engine answers ``EngineReady`` (a
prefill engine first connects to the decode engines the hello names, which accept or
refuse its model). Then it loops: take every waiting message (requests, aborts, KV
from prefill engines), run one step if any request is unfinished, push the outputs
to its frontend. It blocks on its socket only while idle. It pushes stats every
``STATS_INTERVAL`` seconds (a heartbeat), and sooner when its counts change (at once when it
goes idle), so the frontend's gauges fall back to idle values as soon as the work is done.

A launched engine exits on ``Shutdown``, when its launcher is gone, or on SIGTERM/SIGINT (at
once while it starts; once drained while it serves: ``duoserve.engine.lifecycle``). A standalone one
outlives its frontends and serves any number of them at once (several API servers behind
a load balancer): each frontend names itself in its hello (``frontend_id``), and the engine
keeps their requests apart by prefixing every request id with the frontend's tag
(``TAG|request id``). A prefill engine hands that tagged id to the decode engine with the
KV, so the decode engine routes the outputs to the same frontend, whichever engine it said
hello to first. A frontend's aborts reach only its own requests. A frontend that says
``Shutdown``, whose connection drops (a send to it fails) or that says hello again on a
new connection loses its requests; the others never notice. With a key
(``duoserve.transport.auth``) only holders of the deployment key get a hello through at all.
"""

from __future__ import annotations

import logging
import os
import time
import traceback
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from duoserve import envs

if TYPE_CHECKING:
    from duoserve.engine.lifecycle import StopSignals

STATS_INTERVAL = 1.0        # stats go out at least this often (a heartbeat of the application)...
STATS_ON_CHANGE_S = 0.25    # ...and within this long of a change in the counts, at once when idle
IDLE_POLL_MS = 100
TAG_SEP = "|"                # between a frontend's tag and its request id, inside the engine
FAILED_START_WAIT_S = 30.0   # how long an engine that cannot start waits to tell a frontend why

logger = logging.getLogger(__name__)


def engine_main(config_bytes: bytes, address: str | list[str], log_level: int = logging.INFO,
                parent_pid: int | None = None, auth_secret: bytes | None = None,
                on_start_failure: Callable[[str, bool], None] | None = None,
                signals: StopSignals | None = None, name: str | None = None) -> int:
    """Process entry point (import-light: torch and the model load after the socket is bound).

    ``address``: where to listen, or several (a Ray engine listens on TCP for frontends on
    other hosts and on ``ipc://`` for KV from prefill engines on its own).
    ``parent_pid``: the launcher's pid; the engine stops when that process is gone.
    ``auth_secret``: the deployment's CURVE secret key; None accepts any peer.
    ``on_start_failure``: called with (reason, is a config error) when the engine cannot start;
    the first hello is then answered with the reason, as it is for a launched engine.
    ``signals``: a launched engine's ``StopSignals``: it drains on SIGTERM/SIGINT once it serves.
    ``name``: the engine's name where its launcher gave one (else a frontend's hello names it).
    Returns an exit status: 0 after a shutdown, 1 when the engine could not start.
    """
    import zmq

    from duoserve import messages as msg
    from duoserve.transport.auth import AuthKey

    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s engine: %(message)s")
    log = logging.getLogger(__name__)
    _pin(config_bytes)
    addresses = [address] if isinstance(address, str) else list(address)
    ctx = zmq.Context.instance()
    key = None if auth_secret is None else AuthKey.from_secret(auth_secret, "auth_key")
    gate, sock = _engine_socket(ctx, key, addresses)
    try:
        try:
            _fault_start_sleep()
            core = _start_core(config_bytes)
        except Exception as exc:  # a bad config or model: say why (to the launcher), then stop
            told = parent_pid is not None or on_start_failure is not None
            reason, config_error = _start_failure(exc, told)
            if signals is not None:   # before anyone is told: the stop they then send says nothing more
                signals.failed = True
            if on_start_failure is not None:
                on_start_failure(reason, config_error)
            if told:
                _refuse(sock, msg.EngineFailed(reason, config_error))
            return 1
        server = EngineServer(core, sock, parent_pid, key, signals, name)
        if signals is not None:
            signals.start_serving(core.config.shutdown_timeout)
        log.info("%s engine listening on %s", core.config.role, ", ".join(addresses))
        _serve(server, addresses[0])
        return 0
    finally:
        sock.close(linger=1000)
        gate.close()
        ctx.term()


def _engine_socket(ctx, key, addresses: list[str]):
    """The engine's one ROUTER socket, bound to every address, behind the deployment key's gate."""
    import zmq

    from duoserve.transport.auth import Gatekeeper, restrict_ipc
    from duoserve.transport.heartbeat import keep_alive

    gate = Gatekeeper(ctx, key)
    sock = gate.guard(keep_alive(ctx.socket(zmq.ROUTER)))
    sock.setsockopt(zmq.ROUTER_HANDOVER, 1)   # a reconnecting frontend or peer takes over its identity
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a vanished frontend fails: it is dropped, not waited for
    sock.setsockopt(zmq.SNDHWM, 0)            # a ROUTER drops what exceeds its limit: never drop outputs
    for each in addresses:
        sock.bind(each)
        restrict_ipc(each)
    return gate, sock


def _start_failure(exc: Exception, told: bool) -> tuple[str, bool]:
    """Why the engine could not start, for its launcher, and whether it is a config error (a bad
    config or model: the launcher prints it as its own one-line error, so it is logged quietly)."""
    from duoserve.errors import ConfigError, ModelLoadError

    config_error = isinstance(exc, (ConfigError, ModelLoadError))
    logger.log(logging.DEBUG if told and config_error else logging.ERROR, "engine failed to start: %s", exc)
    return (str(exc) if config_error else f"{type(exc).__name__}: {exc}"), config_error


def _serve(server: EngineServer, address: str) -> None:
    """Run the engine's loop until it stops; its connector and core closed however it ends."""
    from duoserve import messages as msg

    core = server.core
    try:
        server.run()
    except KeyboardInterrupt:  # a standalone engine: SIGINT or SIGTERM (see duoserve.cli)
        logger.info("%s engine on %s stopping: aborted its %d requests", core.config.role, address, core.reset())
    except Exception:
        server.send(msg.EngineFailed(traceback.format_exc(limit=5)))
        raise
    finally:
        if core.connector is not None:
            core.connector.close()
        if server.kv_events is not None:
            server.kv_events.close()
        core.close()


def launched_engine_main(name: str, environ: dict[str, str], config_bytes: bytes, address: str | list[str],
                         log_level: int, parent_pid: int, auth_secret: bytes | None) -> int:
    """``engine_main`` in a process a frontend started from its fork server
    (``duoserve.frontend.launcher``): the launcher's environment as it is now (the server was
    forked earlier, maybe with another), a process name that ``ps`` and ``top`` show, and an
    end with the launcher, or on SIGTERM/SIGINT, at any stage (``duoserve.engine.lifecycle``)."""
    from duoserve.engine.lifecycle import StopSignals, stop_with_launcher

    signals = StopSignals().install()   # first: a SIGTERM from now on is obeyed
    os.environ.clear()
    os.environ.update(environ)
    _set_process_name(f"duoserve-{name}")
    _leave_fork_server()
    stop_with_launcher(parent_pid)
    return engine_main(config_bytes, address, log_level, parent_pid, auth_secret, signals=signals, name=name)


def _leave_fork_server() -> None:
    """Close this process's end of the pipe that keeps its fork server alive: the launcher stops
    that server once its engines are up (``launcher.stop_engine_server``), which waits for every
    holder of the pipe to let go; an engine that needs a process of its own starts a new server."""
    import multiprocessing.forkserver

    server = multiprocessing.forkserver._forkserver
    fd = getattr(server, "_forkserver_alive_fd", None)
    if fd is not None:
        os.close(fd)
        server._forkserver_alive_fd = None


def _set_process_name(name: str) -> None:
    """The kernel's name of this process (``/proc/self/comm``, 15 characters), where it lets us."""
    try:
        Path("/proc/self/comm").write_text(name[:15])
    except OSError:
        pass


def _pin(config_bytes: bytes) -> None:
    """Apply ``cpus`` before torch starts its threads (they inherit the affinity)."""
    import msgspec

    cpus = msgspec.msgpack.decode(config_bytes).get("cpus")
    if cpus:
        os.sched_setaffinity(0, cpus)


def _fault_start_sleep() -> None:
    """Fault injection for tests (documented in docs/architecture.md): the engine sleeps this
    many seconds before it loads, as a first start that builds kernels or compiles would."""
    seconds = envs.DUOSERVE_FAULT_START_SLEEP
    if seconds:
        time.sleep(seconds)


def _start_core(config_bytes: bytes):
    import msgspec

    from duoserve.config import EngineConfig
    from duoserve.engine.builder import build_engine

    config = msgspec.msgpack.decode(config_bytes, type=EngineConfig)
    return build_engine(config)


def _refuse(sock, failure) -> None:
    """Answer the first hello (the launcher's is usually already queued) with ``failure``."""
    from duoserve import messages as msg

    deadline = time.monotonic() + FAILED_START_WAIT_S
    while time.monotonic() < deadline:
        if not sock.poll(100):
            continue
        identity, payload, *_ = sock.recv_multipart()
        try:
            if isinstance(msg.decode_at_engine(payload), msg.Hello):
                sock.send_multipart([identity, msg.encode(failure)])
                return
        except Exception:  # not a frontend's message, or it left meanwhile: keep waiting
            continue


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class EngineServer:
    """One engine's message loop: its frontends, and for prefill/decode roles the KV peers."""

    def __init__(self, core, sock, parent_pid: int | None, key=None, signals: StopSignals | None = None,
                 name: str | None = None) -> None:
        self.core = core
        self.signals = signals   # a launched engine's StopSignals: the loop ends once drained
        self.sock = sock
        self.parent_pid = parent_pid
        # socket identity -> tag of each frontend that said hello: one connection per frontend (a
        # frontend's new connection replaces its old one), so a tag names one identity
        self.frontends: dict[bytes, str] = {}
        self.connection_of: dict[str, int] = {}  # tag -> the number of that connection (Hello.connection)
        self.name = name or f"{core.config.role}-engine"
        self.instance_id = uuid.uuid4().hex
        self.kv_arrived = False   # a transfer came in this turn: step, even with nothing else to do
        self.log = logging.getLogger(__name__)
        from duoserve.engine.role_parts import role_parts

        self.peers = role_parts(core.config.role).peer_link(core, sock, key, self.instance_id, name)
        self.fingerprint_values = self.peers.fingerprint_values
        self.kv_events = self._kv_events(core)

    def _kv_events(self, core):
        """The publisher of this engine's KV events (``--kv-events-endpoint``), or None."""
        events = core.config.kv_events
        if events is None:
            return None
        import zmq

        from duoserve.kv.events import KVEventPublisher

        core.kv.record_events()
        publisher = KVEventPublisher(zmq.Context.instance(), events.endpoint, events.replay_endpoint, self.name)
        self.log.info("KV events on %s%s", events.endpoint,
                      f" (replay on {events.replay_endpoint})" if events.replay_endpoint else "")
        return publisher

    def _publish_kv_events(self) -> None:
        from duoserve.kv.events import BlockRemoved, BlockStored

        medium = "GPU" if self.core.runner.device.type == "cuda" else "CPU"   # where vLLM's say its KV is
        events = []
        for event in self.core.kv.drain_events():
            if event[0] == "stored":
                _, hashes, parent, tokens = event
                events.append(BlockStored(hashes, parent, tokens, self.core.kv.block_size, None, medium))
            else:
                events.append(BlockRemoved(event[1], medium))
        self.kv_events.publish(events)
        self.kv_events.serve_replay()

    def send(self, message) -> None:
        """To every frontend (a failure of the whole engine)."""
        for identity in list(self.frontends):
            self._send_to(identity, message)

    def _send_to(self, identity: bytes, message) -> bool:
        """False, and the frontend's requests aborted, when its connection is gone."""
        import zmq

        from duoserve import messages as msg

        try:
            self.sock.send_multipart([identity, msg.encode(message)], flags=zmq.NOBLOCK)
            return True
        except zmq.ZMQError:   # EHOSTUNREACH under ROUTER_MANDATORY: ZeroMQ dropped the connection
            self._forget_frontend(identity, "its connection dropped")
            return False

    def _forget_frontend(self, identity: bytes, why: str) -> None:
        tag = self.frontends.pop(identity, None)
        if tag is None:
            return
        aborted = self.core.reset(tag + TAG_SEP)
        self.log.info("frontend %s left (%s): aborted its %d requests", tag, why, aborted)

    def _deliver(self, outputs: list, stats) -> None:
        """Each frontend gets its own requests' outputs (untagged), and every frontend the stats."""
        from duoserve import messages as msg

        by_tag: dict[str, list] = {}
        for output in outputs:
            tag, _, request_id = output.request_id.partition(TAG_SEP)
            output.request_id = request_id
            by_tag.setdefault(tag, []).append(output)
        for identity, tag in list(self.frontends.items()):
            mine = by_tag.pop(tag, [])
            if mine or stats is not None:
                self._send_to(identity, msg.EngineOutputs(mine, stats))
        for tag in by_tag:   # requests of a frontend that is not connected here (any more): nobody waits
            aborted = self.core.reset(tag + TAG_SEP)
            self.log.warning("frontend %s is not connected to this engine: aborted its %d requests", tag, aborted)

    def run(self) -> None:
        import zmq

        last_stats, last_signature = 0.0, None
        poller = self._poller()
        # fault injection for tests (documented in docs/architecture.md): the first step with
        # work sleeps this many seconds, as a long step on an overloaded machine would
        fault_sleep = envs.DUOSERVE_FAULT_STEP_SLEEP
        while True:
            outputs, self.kv_arrived = [], False
            busy = self.core.has_work()
            events = dict(poller.poll(0 if busy else IDLE_POLL_MS))
            while self.sock in events or self.sock.poll(0, zmq.POLLIN):
                events.pop(self.sock, None)
                produced = self._receive()
                if produced is None:
                    return
                if produced == "rewired":
                    poller = self._poller()
                    continue
                outputs += produced
            peer_sockets = self.core.connector.sockets() if self.core.connector is not None else []
            # when idle the poll above waited, so leased KV is checked for acks and deadlines
            # once per IDLE_POLL_MS, not in a busy loop
            if self.core.has_unfinished() or self.kv_arrived or any(s in events for s in peer_sockets):
                if fault_sleep and self.core.has_work():
                    time.sleep(fault_sleep)
                    fault_sleep = 0.0
                outputs += self.core.step()
            if self.kv_events is not None:
                self._publish_kv_events()
            now = time.monotonic()
            stats = None
            draining = self.signals is not None and self.signals.draining
            signature = (self.core.load_signature(), draining)   # a drain's start is told at once
            changed = signature != last_signature and (not self.core.has_work() or
                                                       now - last_stats >= STATS_ON_CHANGE_S)
            if changed or now - last_stats >= STATS_INTERVAL:
                # the stats double as a probe: a frontend whose connection is gone is dropped here
                stats, last_stats, last_signature = self.core.stats(), now, signature
                stats.draining = draining
                # the serving loop's check, where stop_with_launcher found no pidfd to wait on
                if self.parent_pid is not None and not _pid_alive(self.parent_pid):
                    self.log.warning("the process that launched this engine is gone: stopping")
                    return
            if outputs or stats is not None:
                self._deliver(outputs, stats)
            if self.signals is not None and self.signals.drained(self.core.has_unfinished()):
                self._end_drain()
                return

    def _end_drain(self) -> None:
        """Drained after a SIGTERM/SIGINT: what is still here ends with the process."""
        if self.core.has_unfinished():
            self.log.warning("the drain deadline passed: stopping with %d requests unfinished",
                             self.core.scheduler.num_unfinished)
        else:
            self.log.info("drained: stopping")
        self.core.reset()

    def _poller(self):
        import zmq

        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        if self.kv_events is not None and self.kv_events.replay is not None:   # answered while idle too
            poller.register(self.kv_events.replay, zmq.POLLIN)
        for sock in self.core.connector.sockets() if self.core.connector is not None else []:
            poller.register(sock, zmq.POLLIN)
        return poller

    def _receive(self):
        """Take one message: returns its outputs, "rewired" after a hello, or None to stop."""
        from duoserve import messages as msg

        identity, payload, *frames = self.sock.recv_multipart(copy=False)
        identity = identity.bytes
        try:
            message = msg.decode_at_engine(payload.bytes)
        except Exception as exc:  # a malformed message is dropped, never fatal...
            self.log.error("dropped a malformed message: %s", exc)
            return self._refuse_request(identity, payload.bytes, exc)
        if isinstance(message, (msg.PeerHello, msg.TransferMeta)):
            self.kv_arrived |= self.peers.receive(identity, message, frames)
            return []
        if isinstance(message, msg.Hello):
            self._hello(identity, message)
            return "rewired"
        tag = self.frontends.get(identity)
        if tag is None:
            self.log.error("dropped %s from a frontend that has not said hello", type(message).__name__)
            return []
        if isinstance(message, msg.Shutdown):
            if self.parent_pid is not None:
                return None
            self._forget_frontend(identity, "it said Shutdown")
            return []
        try:
            return self._apply(tag, message)
        except Exception as exc:
            self.log.error("cannot apply %s: %s", type(message).__name__, exc)
            return []

    def _refuse_request(self, identity: bytes, payload: bytes, exc: Exception) -> list:
        """...but a request the engine cannot read fails at once, so that nobody waits for it."""
        import msgspec

        from duoserve.core.outputs import EngineCoreOutput

        try:
            raw = msgspec.msgpack.decode(payload)
        except msgspec.DecodeError:
            return []
        tag = self.frontends.get(identity)
        if tag is None or not isinstance(raw, dict) or raw.get("type") != "AddRequest":
            return []
        request_id = raw.get("request_id")
        if not isinstance(request_id, str):
            return []
        return [EngineCoreOutput(tag + TAG_SEP + request_id, [], finish_reason="error",
                                 error=f"the engine could not read this request: {exc}")]

    def _hello(self, identity: bytes, hello) -> None:
        """A frontend joins (or says hello again: a prefill engine then takes the decode engines
        it names, e.g. one that came back at another address)."""
        from duoserve import messages as msg

        # neither separator in a tag: "|" ends it, "/" starts a sample's index
        tag = (hello.frontend_id or identity.hex()).replace(TAG_SEP, "_").replace("/", "_")
        previous = next((i for i, t in self.frontends.items() if t == tag), None)
        if previous is not None and previous != identity:   # the same frontend on a new connection...
            if hello.connection < self.connection_of.get(tag, 0):   # ...or a hello of an older one, read late
                self.log.info("ignored a hello from an earlier connection of frontend %s", tag)
                return
            self.frontends.pop(previous, None)
            aborted = self.core.reset(tag + TAG_SEP)
            if aborted:
                self.log.warning("frontend %s reconnected: aborted the %d requests of its previous connection",
                                 tag, aborted)
        if identity not in self.frontends:
            self.log.info("frontend %s connected (%d connected)", tag, len(self.frontends) + 1)
        self.frontends[identity], self.name = tag, hello.name
        self.connection_of[tag] = hello.connection
        try:
            self.peers.on_hello(hello)
        except Exception as exc:  # a prefill engine that cannot reach the decode engines named
            self.log.error("%s", exc)
            self._send_to(identity, msg.EngineFailed(str(exc)))
            return
        self._send_to(identity, _ready(self.core, self.fingerprint_values, self.instance_id))

    def _apply(self, tag: str, message) -> list:
        from duoserve import messages as msg

        core = self.core
        if isinstance(message, msg.ChangeAdapter):
            return _change_adapter_answer(core, tag, message)
        request_id = tag + TAG_SEP + message.request_id
        if isinstance(message, msg.AddRequest):
            from duoserve.core.outputs import EngineCoreOutput
            from duoserve.engine.core import AdapterRefused

            try:
                core.add_request(message.to_request(request_id), message.kv_peer, message.kv_peer_instance)
            except AdapterRefused as exc:   # this request's error; the engine serves on
                return [EngineCoreOutput(request_id, [], finish_reason="error", error=str(exc))]
            return []
        if isinstance(message, msg.AbortRequest):
            return core.abort(request_id)
        if isinstance(message, msg.FinishStopped):
            core.finish_stopped(request_id)
        elif isinstance(message, msg.ReleaseRequest):
            core.release(request_id)
        return []


def _change_adapter_answer(core, tag: str, message) -> list:
    from duoserve.core.outputs import EngineCoreOutput

    try:
        reason, error = core.change_adapter(message.name, message.path)
    except Exception as exc:   # answered all the same: the frontend waits for it
        reason, error = "error", f"{type(exc).__name__}: {exc}"
    return [EngineCoreOutput(tag + TAG_SEP + message.op_id, [], finish_reason=reason, error=error)]


def _tokenizer_json(tok) -> str:
    """The text of the file the tokenizer was parsed from where it has one (Gemma 3's takes 0.35 s
    to serialize again), else its serialization."""
    if tok.source_file is not None:
        try:
            return tok.source_file.read_text(encoding="utf-8")
        except OSError:
            pass
    return tok.backend.to_str()


def _ready(core, fingerprint: dict, instance_id: str):
    from duoserve.messages import EngineReady

    tok = core.tokenizer
    return EngineReady(
        role=core.config.role, instance_id=instance_id, fingerprint=fingerprint,
        max_model_len=core.max_model_len, vocab_size=core.vocab_size, eos_token_ids=list(core.eos_token_ids),
        num_blocks=core.num_blocks, block_size=core.config.cache.block_size, model_path=str(core.loaded.path),
        tokenizer_json=None if tok is None else _tokenizer_json(tok),
        bos_token_id=None if tok is None else tok.bos_token_id,
        add_bos_token=False if tok is None else tok.add_bos_token,
        chat_template=None if tok is None else tok.chat_template, memory=core.memory,
        pooling=core.loaded.pooling, reranker=core.loaded.reranker, score_template=core.loaded.score_template,
        tokenizer_file=None if tok is None or tok.source_file is None else str(tok.source_file),
    )
