"""KV-cache events for cluster routers (llm-d, KServe, NVIDIA Dynamo), in vLLM's format.

An engine started with ``--kv-events-endpoint tcp://*:PORT`` publishes what its prefix cache
holds: ``BlockStored`` when full blocks are published (their hashes, the hash of the block before
the first, their tokens, the block size), ``BlockRemoved`` when cached blocks are evicted, and
``AllBlocksCleared`` first thing, so that a router drops what the engine held before a relaunch.
A step's events go out as one batch after the step: a ZeroMQ PUB message of three frames, the
topic (``kv-events.<engine name>``: subscribers of ``kv-events``, or of everything, get every
engine's), the batch's number (8 bytes, big-endian, counting from 0 in each engine process) and
the batch encoded as msgpack the way vLLM's ``msgspec`` structures encode (``array_like`` and
tagged: ``[ts, [["BlockStored", hashes, parent, tokens, block_size, lora_id, medium], ...]]``).
With ``--kv-events-replay-endpoint`` a ROUTER socket answers a request carrying a batch number
with every batch it still holds from that one on (the last ``REPLAY_BUFFER``), each as [number,
batch], then [-1, empty], as vLLM's does. Each engine binds the endpoints' ports plus its index in
the deployment (``engine-1``: port + 1; decode engines first, then prefill engines:
``config.KVEventsConfig.for_engine``). The hashes are the prefix cache's own (32-byte SHA-256
digests chained block to block), so a router hashing a prompt the same way finds where it is cached.
"""

from __future__ import annotations

import time
from collections import deque

import msgspec

TOPIC = "kv-events"
REPLAY_BUFFER = 10_000
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """What vLLM's ``vllm.distributed.kv_events`` events are: tagged by class name."""


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


class KVEventPublisher:
    """One engine's publisher: ``publish`` a step's events, ``serve_replay`` between steps."""

    def __init__(self, ctx, endpoint: str, replay_endpoint: str | None, engine_name: str) -> None:
        import zmq

        self.pub = ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.SNDHWM, REPLAY_BUFFER)
        self.pub.bind(endpoint)
        self.replay = None
        if replay_endpoint:
            self.replay = ctx.socket(zmq.ROUTER)
            self.replay.bind(replay_endpoint)
        self.topic = f"{TOPIC}.{engine_name}".encode()
        self.sequence = 0
        self.sent: deque[tuple[int, bytes]] = deque(maxlen=REPLAY_BUFFER)
        self.encoder = msgspec.msgpack.Encoder()
        self.publish([AllBlocksCleared()])   # whatever an earlier process under this name held is gone

    def publish(self, events: list[KVCacheEvent]) -> None:
        if not events:
            return
        payload = self.encoder.encode(KVEventBatch(ts=time.time(), events=events))
        number = self.sequence.to_bytes(8, "big")
        self.pub.send_multipart([self.topic, number, payload])
        self.sent.append((self.sequence, payload))
        self.sequence += 1

    def serve_replay(self) -> None:
        """Answer every replay request waiting: the batches from the number asked for on."""
        import zmq

        while self.replay is not None and self.replay.poll(0, zmq.POLLIN):
            frames = self.replay.recv_multipart()
            client, start = frames[0], int.from_bytes(frames[-1], "big") if len(frames[-1]) == 8 else 0
            for number, payload in self.sent:
                if number >= start:
                    self.replay.send_multipart([client, b"", number.to_bytes(8, "big"), payload])
            self.replay.send_multipart([client, b"", END_OF_REPLAY, b""])

    def close(self) -> None:
        self.pub.close(linger=500)
        if self.replay is not None:
            self.replay.close(linger=0)
