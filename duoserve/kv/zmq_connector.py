"""KV connectors between engine processes, over ZeroMQ.

Every engine listens on one ROUTER socket (its address). A prefill engine connects a
DEALER socket to each decode engine it is told of, says ``PeerHello`` with its model
fingerprint values and is welcomed or refused (a different model, named value by
value, before any request moves). Then a transfer is a ``TransferMeta`` message
followed by the wire frames (``duoserve.kv.wire``), answered by a ``TransferAck``:

- to a ``tcp://`` peer the frames travel as ZeroMQ frames, sent without copying;
- to an ``ipc://`` peer (same host) they are written once into a shared-memory
  segment and only its name travels; the receiver reads them and unlinks it. A segment
  whose receiver never acknowledges it (it died) is unlinked by the sender when the
  transfer's lease ends; segments left by a process that died (``duoserve-kv-PID-*``
  of a PID no longer running) are unlinked when an engine starts.

A transfer reports its bytes and seconds (``last_transfer``) for the metrics.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from multiprocessing import shared_memory

import msgspec
import zmq

from duoserve import messages as msg
from duoserve.errors import DuoserveError
from duoserve.kv import wire
from duoserve.kv.connector import KVTransfer
from duoserve.model.fingerprint import describe_difference
from duoserve.transport.auth import HANDSHAKE_FAILED, AuthKey, handshake_refused, limit_messages, secure_client
from duoserve.transport.heartbeat import keep_alive

logger = logging.getLogger(__name__)

class PeerRefusedError(DuoserveError):
    """A decode engine refused (or never answered) a prefill engine's PeerHello."""


class KVSendError(DuoserveError):
    """A transfer could not be sent (its decode engine is not connected)."""


def _untrack(segment: shared_memory.SharedMemory) -> None:
    """Hand a created segment's lifetime to the protocol: the receiver unlinks it.

    Python registers every segment it creates or opens with its resource tracker, which
    would unlink it when the sender exits; the receiver's ``unlink`` unregisters its own."""
    try:
        from multiprocessing import resource_tracker

        resource_tracker.unregister(segment._name, "shared_memory")  # noqa: SLF001 (no public API)
    except Exception:  # nothing registered: nothing to undo
        pass


SEGMENT_PREFIX = "duoserve-kv-"
SHM_DIR = "/dev/shm"


def _segment_name() -> str:
    return f"{SEGMENT_PREFIX}{os.getpid()}-{secrets.token_hex(6)}"


def _unlink_segment(name: str) -> bool:
    """Unlink a segment this side created; False if it is gone already (the receiver took it)."""
    try:
        segment = shared_memory.SharedMemory(name=name)
    except FileNotFoundError:
        return False
    segment.close()
    segment.unlink()
    return True


def sweep_orphaned_segments(directory: str = SHM_DIR) -> list[str]:
    """Unlink this user's KV segments whose creating process is gone; returns their names."""
    swept = []
    try:
        names = os.listdir(directory)
    except OSError:   # no /dev/shm here: nothing to sweep
        return swept
    for name in names:
        if not name.startswith(SEGMENT_PREFIX):
            continue
        pid = name[len(SEGMENT_PREFIX):].partition("-")[0]
        try:
            if not pid.isdigit() or os.stat(os.path.join(directory, name)).st_uid != os.getuid():
                continue
            os.kill(int(pid), 0)
            continue   # its creator still runs: its lease decides
        except ProcessLookupError:
            pass
        except OSError:   # gone meanwhile, or a process of another user (alive): leave it
            continue
        if _unlink_segment(name):
            swept.append(name)
    if swept:
        logger.warning("unlinked %d shared-memory KV segment(s) left by processes that died: %s",
                       len(swept), ", ".join(swept))
    return swept


def _write_shm(frames: list, sizes: list[int]) -> str:
    segment = shared_memory.SharedMemory(name=_segment_name(), create=True, size=max(sum(sizes), 1))
    _untrack(segment)
    offset = 0
    for frame, size in zip(frames, sizes):
        segment.buf[offset:offset + size] = frame
        offset += size
    segment.close()  # the receiver unlinks it
    return segment.name


def _read_shm(name: str, sizes: list[int]) -> list[bytes]:
    segment = shared_memory.SharedMemory(name=name)  # unlink() below also untracks it
    try:
        frames, offset = [], 0
        for size in sizes:
            frames.append(bytes(segment.buf[offset:offset + size]))
            offset += size
        return frames
    finally:
        segment.close()
        segment.unlink()


class PrefillConnector:
    """A prefill engine's end: a DEALER socket per decode engine; sends KV, takes acks."""

    def __init__(self, fingerprint: bytes, values: dict, key: AuthKey | None = None) -> None:
        self.ctx = zmq.Context.instance()
        self.fingerprint = fingerprint
        self.values = values
        self.key = key
        self.peers: dict[str, zmq.Socket] = {}
        self.addresses: dict[str, str] = {}
        self.last_transfer: tuple[int, float] = (0, 0.0)   # bytes, seconds
        self.segments: dict[str, tuple[str, float]] = {}  # request id -> its unacknowledged segment, sent at

    def connect(self, name: str, peers: dict[str, str], timeout: float = 300.0) -> None:
        """Connect to each decode engine of ``peers`` not yet connected at that address, and have
        each accept this engine's model. Every frontend's hello names the peers: one already
        connected stays as it is (transfers in flight go on), one at a new address (it came
        back elsewhere) is connected afresh."""
        fresh: dict[str, zmq.Socket] = {}
        for peer, address in peers.items():
            if self.addresses.get(peer) == address:
                continue
            self._drop(peer)
            sock = secure_client(limit_messages(keep_alive(self.ctx.socket(zmq.DEALER))), self.key)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.LINGER, 1000)
            sock.connect(address)
            sock.send(msg.encode(msg.PeerHello(name, self.values)))
            self.peers[peer], self.addresses[peer] = sock, address
            fresh[peer] = sock
        deadline = time.monotonic() + timeout
        for peer, sock in fresh.items():
            try:
                self._await_answer(sock, peer, name, deadline, timeout)
                reply = msg.decode_at_prefill_peer(sock.recv())
                if isinstance(reply, msg.PeerRefused):
                    raise PeerRefusedError(reply.error)
            except PeerRefusedError:
                self._drop(peer)   # a later hello tries it again
                raise
        if fresh:
            logger.info("%s connected to decode engines %s", name,
                        ", ".join(f"{p} ({self.addresses[p]})" for p in fresh))

    def _drop(self, peer: str) -> None:
        sock = self.peers.pop(peer, None)
        self.addresses.pop(peer, None)
        if sock is not None:
            sock.close(linger=0)

    def _await_answer(self, sock: zmq.Socket, peer: str, name: str, deadline: float, timeout: float) -> None:
        """Wait for a decode engine's answer; a refused handshake (another key) fails at once."""
        monitor = sock.get_monitor_socket(HANDSHAKE_FAILED)
        try:
            while not sock.poll(100):
                if monitor.poll(0):
                    raise PeerRefusedError(f"decode engine {peer}: {handshake_refused(self.addresses[peer], self.key)}")
                if time.monotonic() >= deadline:
                    raise PeerRefusedError(f"decode engine {peer} at {self.addresses[peer]} did not answer "
                                           f"{name}'s hello within {timeout:g} s")
        finally:
            sock.disable_monitor()
            monitor.close(linger=0)

    def sockets(self) -> list[zmq.Socket]:
        return list(self.peers.values())

    def send(self, transfer: KVTransfer) -> None:
        sock = self.peers.get(transfer.peer)
        if sock is None:
            raise KVSendError(f"no decode engine named {transfer.peer!r} is connected "
                              f"(connected: {', '.join(self.peers) or 'none'})")
        start = time.perf_counter()
        frames = wire.encode(transfer.keys, transfer.values, transfer.meta.prompt_token_ids, self.fingerprint)
        sizes = [len(f) for f in frames]
        if self.addresses[transfer.peer].startswith("ipc://"):
            meta = msgspec.structs.replace(transfer.meta, frame_sizes=sizes, shm_name=_write_shm(frames, sizes))
            self.segments[transfer.request_id] = (meta.shm_name, time.monotonic())
            sock.send(msg.encode(meta))
        else:
            meta = msgspec.structs.replace(transfer.meta, frame_sizes=sizes)
            sock.send_multipart([msg.encode(meta), *frames], copy=False)
        self.last_transfer = (sum(sizes), time.perf_counter() - start)

    def poll_acks(self) -> list[str]:
        acks = []
        for sock in self.peers.values():
            while sock.poll(0):
                message = msg.decode_at_prefill_peer(sock.recv())
                if isinstance(message, msg.TransferAck):
                    acks.append(message.request_id)
                    self.segments.pop(message.request_id, None)   # the receiver unlinked it
        return acks

    def sweep(self, max_age: float) -> int:
        """Unlink segments unacknowledged for ``max_age`` seconds (their lease is over)."""
        now, swept = time.monotonic(), 0
        for request_id, (name, sent_at) in list(self.segments.items()):
            if now - sent_at >= max_age:
                del self.segments[request_id]
                swept += _unlink_segment(name)
        if swept:
            logger.warning("unlinked %d shared-memory KV segment(s) that no decode engine took", swept)
        return swept

    def close(self) -> None:
        for sock in self.peers.values():
            sock.close(linger=0)
        self.peers, self.addresses = {}, {}
        for name, _ in self.segments.values():   # this engine stops: nobody will take them now
            _unlink_segment(name)
        self.segments = {}


class DecodeConnector:
    """A decode engine's end: transfers arrive on the engine's own ROUTER socket (``receive``)."""

    def __init__(self, sock: zmq.Socket, fingerprint: bytes, values: dict, instance_id: str) -> None:
        self.sock = sock
        self.fingerprint = fingerprint
        self.values = msgspec.msgpack.decode(msgspec.msgpack.encode(values))  # as a peer's arrive
        self.instance_id = instance_id
        self.name = "decode engine"     # until a frontend names it
        self._arrived: list[KVTransfer] = []
        self._senders: dict[str, bytes] = {}   # request id -> the prefill engine's socket identity

    def sockets(self) -> list[zmq.Socket]:
        return []

    def close(self) -> None:
        pass  # the socket is the engine's own

    def receive(self, identity: bytes, message, frames: list) -> None:
        """A ``PeerHello`` (answered at once) or a ``TransferMeta`` and its frames (kept for the engine)."""
        if isinstance(message, msg.PeerHello):
            self._answer_hello(identity, message)
            return
        try:
            data = (_read_shm(message.shm_name, message.frame_sizes) if message.shm_name is not None
                    else [f.buffer for f in frames])
            if message.instance_id != self.instance_id:
                raise wire.KVWireError("it was sent to an earlier decode engine at this address")
            _, keys, values = wire.decode(data, self.fingerprint, message.prompt_token_ids)
        except (wire.KVWireError, FileNotFoundError) as exc:
            logger.error("refused the KV of request %s: %s", message.request_id, exc)
            return
        self._senders[message.request_id] = identity
        self._arrived.append(KVTransfer(message, keys, values, received_at=time.monotonic()))

    def _answer_hello(self, identity: bytes, hello: msg.PeerHello) -> None:
        difference = describe_difference(hello.name, hello.fingerprint, self.name, self.values)
        if difference is None:
            reply = msg.PeerWelcome(self.name, self.instance_id)
        else:
            logger.error("refused prefill engine %s: a different model (%s)", hello.name, difference)
            reply = msg.PeerRefused(f"{hello.name} and {self.name} serve different models ({difference})")
        self._send_to(identity, reply)

    def poll_transfers(self) -> list[KVTransfer]:
        arrived, self._arrived = self._arrived, []
        return arrived

    def acknowledge(self, request_id: str) -> None:
        identity = self._senders.pop(request_id, None)
        if identity is not None:
            self._send_to(identity, msg.TransferAck(request_id))

    def _send_to(self, identity: bytes, message) -> None:
        try:
            self.sock.send_multipart([identity, msg.encode(message)], flags=zmq.NOBLOCK)
        except zmq.ZMQError:   # the prefill engine is gone (its lease ends on its own side, if it comes back)
            logger.info("a prefill engine left before %s reached it", type(message).__name__)
