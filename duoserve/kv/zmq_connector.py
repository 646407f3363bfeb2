"""KV connectors between engine processes, over ZeroMQ.

Each end binds one PULL socket and connects a PUSH socket to the other's: the decode
end receives transfers on ``kv_addr``, the prefill end receives acknowledgements on
``ack_addr``. A transfer is a ``TransferMeta`` message followed by the wire frames
(``duoserve.kv.wire``):

- ``tcp``: the frames travel as ZeroMQ frames, sent without copying the tensors;
- ``shm`` (same host): the frames are written once into a shared-memory segment and
  only its name travels; the receiver reads them in place and unlinks the segment.

A transfer reports its bytes and seconds (``last_transfer``) for the metrics.
"""

from __future__ import annotations

import logging
import time
from multiprocessing import shared_memory

import zmq

from duoserve.engine import messages as msg
from duoserve.kv import wire
from duoserve.kv.connector import KVTransfer

logger = logging.getLogger(__name__)
TRANSPORTS = ("shm", "tcp")


def _untrack(segment: shared_memory.SharedMemory) -> None:
    """Hand a created segment's lifetime to the protocol: the receiver unlinks it.

    Python registers every segment it creates or opens with its resource tracker, which
    would unlink it when the sender exits; the receiver's ``unlink`` unregisters its own."""
    try:
        from multiprocessing import resource_tracker

        resource_tracker.unregister(segment._name, "shared_memory")  # noqa: SLF001 (no public API)
    except Exception:  # nothing registered: nothing to undo
        pass


class _End:
    def __init__(self, listen: str, peer: str) -> None:
        self.ctx = zmq.Context.instance()
        self.inbox = self.ctx.socket(zmq.PULL)
        self.inbox.bind(listen)
        self.outbox = self.ctx.socket(zmq.PUSH)
        self.outbox.setsockopt(zmq.SNDHWM, 0)
        self.outbox.connect(peer)

    def sockets(self) -> list[zmq.Socket]:
        return [self.inbox]

    def close(self) -> None:
        self.inbox.close(linger=0)
        self.outbox.close(linger=1000)


class PrefillEnd(_End):
    """Sends transfers to the decode engine, receives its acknowledgements."""

    def __init__(self, ack_addr: str, kv_addr: str, fingerprint: bytes, transport: str = "shm") -> None:
        super().__init__(ack_addr, kv_addr)
        self.fingerprint = fingerprint
        self.transport = transport
        self.last_transfer: tuple[int, float] = (0, 0.0)   # bytes, seconds

    def send(self, transfer: KVTransfer) -> None:
        start = time.perf_counter()
        frames = wire.encode(transfer.keys, transfer.values, transfer.prompt_token_ids, self.fingerprint)
        sizes = [len(f) for f in frames]
        meta = msg.TransferMeta(transfer.request_id, transfer.prompt_token_ids, transfer.params,
                                list(transfer.eos_token_ids), transfer.max_total_tokens, transfer.arrival_time,
                                transfer.first_token, transfer.sample_index, sizes,
                                first_logprobs=transfer.first_logprobs, sent_at=transfer.sent_at)
        if self.transport == "shm":
            segment = shared_memory.SharedMemory(create=True, size=sum(sizes))
            _untrack(segment)
            offset = 0
            for frame, size in zip(frames, sizes):
                segment.buf[offset:offset + size] = frame
                offset += size
            meta.shm_name = segment.name
            segment.close()  # the receiver unlinks it
            self.outbox.send(msg.encode(meta))
        else:
            self.outbox.send_multipart([msg.encode(meta), *frames], copy=False)
        self.last_transfer = (sum(sizes), time.perf_counter() - start)

    def poll_acks(self) -> list[str]:
        acks = []
        while self.inbox.poll(0):
            message = msg.decode_between_engines(self.inbox.recv())
            if isinstance(message, msg.TransferAck):
                acks.append(message.request_id)
        return acks


class DecodeEnd(_End):
    """Receives transfers (checked against this engine's fingerprint), sends acknowledgements."""

    def __init__(self, kv_addr: str, ack_addr: str, fingerprint: bytes) -> None:
        super().__init__(kv_addr, ack_addr)
        self.fingerprint = fingerprint

    def poll_transfers(self) -> list[KVTransfer]:
        transfers = []
        while self.inbox.poll(0):
            parts = self.inbox.recv_multipart(copy=False)
            meta = msg.decode_between_engines(parts[0].bytes)
            if not isinstance(meta, msg.TransferMeta):
                continue
            try:
                frames = self._frames(meta, parts[1:])
                _, keys, values = wire.decode(frames, self.fingerprint, meta.prompt_token_ids)
            except wire.KVWireError as exc:
                logger.error("refused the KV of request %s: %s", meta.request_id, exc)
                continue
            transfers.append(KVTransfer(meta.request_id, meta.prompt_token_ids, meta.params,
                                        tuple(meta.eos_token_ids), meta.max_total_tokens, meta.arrival_time,
                                        meta.first_token, meta.sample_index, keys, values, meta.first_logprobs,
                                        sent_at=meta.sent_at, received_at=time.monotonic()))
        return transfers

    def _frames(self, meta: msg.TransferMeta, parts: list) -> list[bytes]:
        if meta.shm_name is None:
            return [p.buffer for p in parts]
        segment = shared_memory.SharedMemory(name=meta.shm_name)  # unlink() below also untracks it
        try:
            frames, offset = [], 0
            for size in meta.frame_sizes:
                frames.append(bytes(segment.buf[offset:offset + size]))
                offset += size
            return frames
        finally:
            segment.close()
            segment.unlink()

    def acknowledge(self, request_id: str) -> None:
        self.outbox.send(msg.encode(msg.TransferAck(request_id)))
