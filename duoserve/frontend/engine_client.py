"""The frontend's side of one engine in another process, on this host or another.

``EngineClient`` is the connection: ``connect`` opens a DEALER socket to the engine's
address, says ``Hello`` and waits for ``EngineReady``. Then it plays the ``EngineHandle``
part: requests and aborts go out as messages, outputs come back through ``recv``. The
tokenizer arrives in ``EngineReady``, so this process never loads the model. A client
with a ``config`` stands for an engine this frontend launches: the launcher
(``duoserve.frontend.launcher``) spawns its process and hands it over as ``process``,
which the client only watches; the supervisor (``duoserve.frontend.supervisor``) decides
when to start, relaunch or reconnect.

An engine is taken for dead when its process exits (launched ones) or its connection drops
(ZeroMQ heartbeats, answered by ZeroMQ's I/O thread whatever the engine's step is doing,
notice a vanished or frozen host within ~4 s). An engine that sends nothing, not even its
once-a-second stats, for ``SILENCE_TIMEOUT`` seconds while its connection still answers is
*slow*, not dead: it is logged, ``/health`` says so, and its requests keep waiting.

Every connection proves the deployment key when there is one (``duoserve.transport.auth``);
an engine that refuses it fails the start at once, naming the key. An engine serves several
frontends at once, each under its own ``frontend_id`` (``duoserve.engine.process``).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import socket
import time
import uuid
from pathlib import Path

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from duoserve import envs
from duoserve.config import EngineConfig
from duoserve.frontend.placement import Rates
from duoserve.core.request import Request
from duoserve import messages as msg
from duoserve.errors import DuoserveError
from duoserve.frontend.tokenizer_preload import backend_of
from duoserve.model.tokenizer import Tokenizer
from duoserve.transport.auth import HANDSHAKE_FAILED, AuthKey, handshake_refused, limit_messages, secure_client
from duoserve.transport.heartbeat import keep_alive

logger = logging.getLogger(__name__)

# an engine connected but silent this long (stats come every second) is reported slow
SILENCE_TIMEOUT = envs.DUOSERVE_SILENCE_TIMEOUT
POLL_S = 0.5


def new_frontend_id() -> str:
    """A frontend's name in its hellos: the engines keep each frontend's requests apart under it."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


FRONTEND_ID = new_frontend_id()   # the default for clients made outside an AsyncEngine


_exit_codes: dict[int, int] = {}   # pid -> exit code, of the engines this process reaped itself


def process_running(process: multiprocessing.process.BaseProcess) -> bool:
    """Whether a launched engine's process runs, asked of its pid: multiprocessing takes an
    engine for ended once the fork server that reports its exit is gone (stopped once the
    engines run, or a SIGTERM to the whole process group), though the engine may still be
    draining. An engine that ended as this process's own child (the fork server gone, it
    became ours: ``launcher.adopt_orphans``) is reaped here."""
    if process.pid is None:
        return False
    try:
        os.kill(process.pid, 0)
        stat = Path(f"/proc/{process.pid}/stat").read_text()
    except ProcessLookupError:
        return False
    except OSError:   # no /proc here, or gone meanwhile: multiprocessing's view
        return process.is_alive()
    if stat.rpartition(")")[2].split()[0] != "Z":
        return True
    try:   # a zombie has ended
        pid, status = os.waitpid(process.pid, os.WNOHANG)
    except ChildProcessError:   # another process's child: its parent reaps it
        return False
    if not pid:   # its leader ended, its other threads still end (not yet waitable)
        return True
    _exit_codes[pid] = os.waitstatus_to_exitcode(status)
    return False


def exit_code(process: multiprocessing.process.BaseProcess) -> int | None:
    """An ended engine's exit code (a signal's as its negative number): multiprocessing's, while
    the fork server that forked it reports it, else the one this process reaped."""
    if process.pid in _exit_codes:
        return _exit_codes[process.pid]
    return process.exitcode


class EngineDeadError(DuoserveError):
    """The engine exited, could not start, or cannot be reached."""


class EngineStartError(EngineDeadError):
    """The engine refused to start; ``config_error``: because of a configuration value (the
    message then names it), not a fault."""

    def __init__(self, message: str, config_error: bool = False) -> None:
        super().__init__(message)
        self.config_error = config_error


class EngineClient:
    def __init__(self, name: str, address: str, config: EngineConfig | None = None,
                 peers: dict[str, str] | None = None, key: AuthKey | None = None,
                 frontend_id: str = FRONTEND_ID) -> None:
        self.name = name
        self.address = address
        self.key = key                  # the deployment's CURVE key (a launched engine gets it too)
        self.frontend_id = frontend_id
        self.config = config            # set: this frontend launches (and relaunches) the engine
        self.peers = peers or {}        # prefill engines: decode engine name -> address
        self._ctx = zmq.asyncio.Context()
        self._sock: zmq.asyncio.Socket | None = None
        self._monitor: zmq.Socket | None = None        # a synchronous view of the monitor socket
        self._monitor_owner: zmq.asyncio.Socket | None = None
        self._lost: str | None = None   # why the connection is gone
        self._refused = False           # ... because the engine refused this side's key
        self._connections = 0           # sockets made so far (told in each hello: a late one is ignored)
        self.slow_since: float | None = None  # silent past SILENCE_TIMEOUT while its connection answers
        self.draining = False                 # its stats say it drains (SIGTERM'd): no new work for it
        self.rates = Rates()                  # what its last stats measured (placement.py)
        self.process: multiprocessing.process.BaseProcess | None = None
        self.ready: msg.EngineReady | None = None
        self.tokenizer: Tokenizer | None = None

    @property
    def launched(self) -> bool:
        return self.config is not None

    @property
    def managed(self) -> bool:
        """This frontend brings the engine up (launches or places it): a failure fails the start."""
        return self.launched

    def current_peers(self) -> dict[str, str]:
        """The decode engines a prefill engine should hand KV to now."""
        return self.peers

    # ---- lifecycle ----------------------------------------------------------------------

    async def connect(self, timeout: float = 300.0) -> None:
        """Open a fresh connection and wait for EngineReady (a launched engine's process is
        started first, by the launcher)."""
        self.ready = None
        self._open_socket()
        self._send(self._hello())
        try:
            message = await self._recv(timeout, waiting_for="EngineReady")
        except EngineDeadError as exc:
            if self._refused:   # another key: a configuration error, said in one line
                raise EngineStartError(f"{self.name}: {self._lost}", config_error=True) from None
            raise exc
        if isinstance(message, msg.EngineFailed):
            if message.config_error:
                raise EngineStartError(message.error, config_error=True)
            raise EngineStartError(f"{self.name} failed to start: {message.error}")
        if not isinstance(message, msg.EngineReady):
            raise EngineDeadError(f"{self.name} sent {type(message).__name__} before EngineReady")
        if message.tokenizer_json is not None:
            self.tokenizer = Tokenizer(backend_of(message),
                                       bos_token_id=message.bos_token_id,
                                       eos_token_ids=tuple(message.eos_token_ids),
                                       chat_template=message.chat_template, add_bos_token=message.add_bos_token)
        # kept without the tokenizer's text, parsed above: Gemma 3's is 13 MB of JSON, 4 bytes a
        # character as a Python string (an emoji in it), for nothing once parsed
        self.ready = msgspec.structs.replace(message, tokenizer_json=None)

    def tell_peers(self, peers: dict[str, str]) -> None:
        """A prefill engine: hand KV to these decode engines from now on (one came back elsewhere)."""
        self.peers = dict(peers)
        self._send(self._hello())   # answered by an EngineReady, ignored

    def _hello(self) -> msg.Hello:
        return msg.Hello(self.name, self.peers, self.frontend_id, self._connections)

    def kv_address_for(self, prefill: "EngineClient") -> str:
        """Where ``prefill`` should send this decode engine KV."""
        return self.address

    def _open_socket(self) -> None:
        """A fresh socket: nothing queued for a dead engine reaches its successor."""
        self._close_sockets()
        sock = secure_client(limit_messages(keep_alive(self._ctx.socket(zmq.DEALER))), self.key)
        sock.setsockopt(zmq.LINGER, 0)
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED | HANDSHAKE_FAILED)
        self._monitor = zmq.Socket.shadow(monitor.underlying)   # read synchronously from is_alive()
        self._monitor_owner = monitor
        sock.connect(self.address)
        self._sock, self._lost, self._refused = sock, None, False
        self._connections += 1

    def _close_sockets(self) -> None:
        if self._sock is not None:
            self._sock.disable_monitor()
            self._monitor_owner.close(linger=0)
            self._sock.close(linger=0)
            self._sock = self._monitor = None

    def is_alive(self) -> bool:
        if self._monitor is not None:
            while self._monitor.poll(0):
                event = parse_monitor_message(self._monitor.recv_multipart())
                if event["event"] & HANDSHAKE_FAILED:
                    self._lost, self._refused = handshake_refused(self.address, self.key), True
                elif event["event"] == zmq.EVENT_DISCONNECTED and self._lost is None:
                    self._lost = f"the connection to {self.address} dropped"
        if self._lost is not None:
            return False
        return not self.launched or (self.process is not None and process_running(self.process))

    def is_up(self) -> bool:
        """Alive and past its EngineReady: it can take requests."""
        return self.ready is not None and self.is_alive()

    @property
    def connected(self) -> bool:
        return self._sock is not None

    def say_shutdown(self) -> None:
        """This frontend leaves: a launched engine stops, a remote one aborts this frontend's requests."""
        if self._sock is not None and self.is_alive():
            try:
                self._send(msg.Shutdown())
            except EngineDeadError:
                pass

    def close(self) -> None:
        """Close the connection for good (after ``say_shutdown`` had time to leave)."""
        self._close_sockets()
        self._ctx.term()

    # ---- EngineHandle -------------------------------------------------------------------

    @property
    def max_model_len(self) -> int:
        return self.ready.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.ready.vocab_size

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return tuple(self.ready.eos_token_ids)

    def _send(self, message: msgspec.Struct) -> None:
        if self._sock is None:
            raise EngineDeadError(f"{self.name} is not connected")
        try:
            self._sock.send(msg.encode(message), flags=zmq.NOBLOCK)
        except zmq.Again:
            raise EngineDeadError(f"{self.name} is not connected") from None

    def send(self, message: msgspec.Struct) -> None:
        """A control message (``ChangeAdapter``); EngineDeadError when it cannot be sent."""
        self._send(message)

    def add_request(self, request: Request, kv_peer: str | None = None, kv_peer_instance: str | None = None) -> None:
        self._send(msg.AddRequest.from_request(request, max_total_tokens=request.max_total_tokens or self.max_model_len,
                                               kv_peer=kv_peer, kv_peer_instance=kv_peer_instance,
                                               output_token_ids=request.output_token_ids))

    def abort(self, request_id: str) -> None:
        self._send(msg.AbortRequest(request_id))

    def finish_stopped(self, request_id: str) -> None:
        self._send(msg.FinishStopped(request_id))

    def release(self, request_id: str) -> None:
        self._send(msg.ReleaseRequest(request_id))

    # ---- outputs ------------------------------------------------------------------------

    async def recv(self) -> msg.EngineOutputs:
        """The next batch of outputs; raises EngineDeadError if the engine dies or falls silent."""
        message = await self._recv(SILENCE_TIMEOUT, waiting_for="outputs")
        if isinstance(message, msg.EngineFailed):
            raise EngineDeadError(f"{self.name} failed: {message.error}")
        if isinstance(message, msg.EngineReady):  # an answer to an earlier hello: nothing new
            return msg.EngineOutputs([])
        return message

    async def _recv(self, timeout: float, waiting_for: str) -> msg.FromEngine:
        deadline = time.monotonic() + timeout
        while True:
            if await self._sock.poll(timeout=POLL_S * 1000):
                if self.slow_since is not None:
                    logger.info("%s answers again after %.0fs of silence", self.name, time.monotonic() - self.slow_since)
                    self.slow_since = None
                return msg.decode_from_engine(await self._sock.recv())
            if not self.is_alive():
                if self._lost is not None:
                    raise EngineDeadError(f"{self.name}: {self._lost} while waiting for {waiting_for}")
                code = None if self.process is None else exit_code(self.process)
                raise EngineDeadError(f"{self.name} exited (exit code {code}) while waiting for {waiting_for}")
            if time.monotonic() >= deadline and waiting_for == "outputs":  # alive and connected: slow
                if self.slow_since is None:
                    self.slow_since = time.monotonic() - timeout
                    logger.warning("%s at %s sent nothing for %.0fs, but its connection answers heartbeats: "
                                   "slow, not down; its requests keep waiting", self.name, self.address, timeout)
                deadline = time.monotonic() + timeout
                continue
            if time.monotonic() >= deadline:
                raise EngineDeadError(f"{self.name} at {self.address} sent nothing for {timeout:.0f}s "
                                      f"while waiting for {waiting_for}")
