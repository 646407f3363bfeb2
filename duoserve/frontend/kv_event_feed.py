"""The frontend's subscription to its engines' KV events (``--routing kv-events``): each event
batch an engine publishes (``duoserve.kv.events``) updates the prefix map the router places by,
so that it knows exactly what every engine caches instead of guessing from its own placements.

One SUB socket connects to every engine launched here that publishes (an endpoint bound on
every interface, ``tcp://*:PORT``, is reached on this host's loopback); the topic names the
engine. Batches an engine sent before the frontend listened are not asked for again: an engine
starts empty, and a frontend that starts after its engines learns from their next stores.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import msgspec

from duoserve.kv.events import TOPIC, AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

logger = logging.getLogger(__name__)


def connect_address(endpoint: str) -> str:
    """Where to connect for an endpoint an engine binds: ``tcp://*:5557`` -> ``tcp://127.0.0.1:5557``."""
    for wildcard in ("tcp://*:", "tcp://0.0.0.0:"):
        if endpoint.startswith(wildcard):
            return "tcp://127.0.0.1:" + endpoint[len(wildcard):]
    return endpoint


class KVEventFeed:
    def __init__(self, endpoints: list[str], prefixes: Callable[[], object]) -> None:
        """``endpoints``: the engines' (as they bind them); ``prefixes()``: the prefix map now (or
        None while no engine is up)."""
        import zmq
        import zmq.asyncio

        self.ctx = zmq.asyncio.Context.instance()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, TOPIC.encode())
        for endpoint in endpoints:
            self.sub.connect(connect_address(endpoint))
        self.prefixes = prefixes
        self.decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.received: dict[str, int] = {}   # engine -> event batches applied (a metric)
        self.task: asyncio.Task | None = None

    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            topic, _, payload = await self.sub.recv_multipart()
            engine = topic.decode().removeprefix(TOPIC + ".")
            try:
                batch = self.decoder.decode(payload)
            except msgspec.DecodeError as exc:
                logger.warning("a KV event batch from %s did not decode (%s): skipped", engine, exc)
                continue
            self.apply(engine, batch)

    def apply(self, engine: str, batch: KVEventBatch) -> None:
        prefixes = self.prefixes()
        if prefixes is None:
            return
        for event in batch.events:
            if isinstance(event, BlockStored):
                prefixes.stored(engine, event.block_hashes)
            elif isinstance(event, BlockRemoved):
                prefixes.removed(engine, event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                prefixes.cleared(engine)
        self.received[engine] = self.received.get(engine, 0) + 1

    async def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
        self.sub.close(linger=0)
