"""The shared KV tier: full KV blocks in Redis, by content, for every engine of the same model.

Keys and values are block records (``duoserve.kv.store_record``, docs/kv-wire-format.md):
engines of other models, dtypes, block sizes or salts never meet a key of each other's; the
same model on two hosts always does. A record that fails its checks on read is a miss, is
deleted, and is never loaded.

Finding a prompt's stored blocks is one pipelined round trip (``EXISTS`` per block); loading
them is pipelined ``GETEX`` (which refreshes the TTL) in batches. New blocks are written by a
background thread from a bounded queue (``SET NX EX``: nobody rewrites what is there); a full
queue drops the block and counts it. Trouble with Redis never fails a request: every call has
``timeout_ms``, a request has a time budget for the tier, and a circuit breaker
(``duoserve.kv.breaker``) stops asking after repeated errors, probing again after a cooldown.

``StoreSource`` is the engine's side: one of the KV sources asked at admission
(``duoserve.core.kv_sources``), right after the prefix cache, and the writer of the blocks the
prefix cache publishes once their KV is computed.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict

import torch

from duoserve.config import KVStoreConfig
from duoserve.core.kv_cache_manager import KVCacheManager
from duoserve.core.kv_sources import KVHit, takes_cached_kv
from duoserve.core.outputs import SchedulerOutput
from duoserve.core.request import Request
from duoserve.errors import KVStoreUnavailable
from duoserve.kv.breaker import CircuitBreaker
from duoserve.kv.reblock import extract_kv
from duoserve.kv.staging import to_host
from duoserve.kv.store_record import KEY_PREFIX, BadRecord, block_key, decode_record, encode_record, store_root

logger = logging.getLogger(__name__)

LOAD_BATCH = 16          # blocks per pipelined GETEX
REQUEST_BUDGET_ROUND_TRIPS = 8  # a request's time with the tier: this many timeouts, then it computes
WRITE_BATCH = 32         # blocks per pipelined SET


def error_kind(error: Exception) -> str:
    import redis

    if isinstance(error, redis.exceptions.TimeoutError):
        return "timeout"
    if isinstance(error, redis.exceptions.ConnectionError):
        return "connection"
    if isinstance(error, redis.exceptions.ResponseError):
        return "refused"
    return "other"


class BlockStore:
    """The engine's side of the tier: ``find``/``load`` on the engine thread, ``submit`` queues
    writes for a background thread."""

    def __init__(self, config: KVStoreConfig, fingerprint: bytes, layout: dict) -> None:
        import redis

        self.config, self.fingerprint, self.layout = config, fingerprint, layout
        self.root = store_root(fingerprint, layout)
        seconds = config.timeout_ms / 1000
        self.client = redis.Redis.from_url(config.url, socket_timeout=seconds, socket_connect_timeout=seconds,
                                           retry_on_timeout=False)
        self.breaker = CircuitBreaker(config.breaker_errors, config.breaker_cooldown, f"the KV store {safe_url(config.url)}")
        self._check_answers()
        self.hits = self.misses = self.bytes_read = self.bytes_written = self.dropped_writes = 0
        self.errors: dict[str, int] = {}
        self.known: OrderedDict[bytes, None] = OrderedDict()   # keys seen in the store (not written again)
        self.writes: queue.Queue = queue.Queue(maxsize=config.write_queue)
        self.lock = threading.Lock()
        self.writer = threading.Thread(target=self._write_loop, name="kv-store-writer", daemon=True)
        self.writer.start()

    def _check_answers(self) -> None:
        """One PING at start: a store that does not answer is a warning naming it (requests
        compute without it, and the breaker retries it), or with ``required`` a refusal to start."""
        try:
            self.client.ping()
        except Exception as exc:  # noqa: BLE001 - any failure to answer is reported the same way
            what = f"the KV store {safe_url(self.config.url)} does not answer ({type(exc).__name__}: {exc})"
            if self.config.required:
                raise KVStoreUnavailable(f"{what}; --kv-store-required: not starting") from exc
            logger.warning("%s: serving without it until it does", what)

    # ---- reads, on the engine thread ------------------------------------------------------

    def _call(self, fn):
        """Run one round trip under the breaker; None when skipped or failed (counted)."""
        if not self.breaker.allow():
            return None
        try:
            result = fn()
        except Exception as exc:  # noqa: BLE001 - Redis trouble never reaches a request
            self._count_error(error_kind(exc))
            self.breaker.failure(exc)
            return None
        self.breaker.success()
        return result

    def _count_error(self, kind: str) -> None:
        with self.lock:
            self.errors[kind] = self.errors.get(kind, 0) + 1

    def fetch(self, block_hashes: list[bytes], tokens_of, deadline: float) -> list:
        """The longest run of stored blocks for ``block_hashes`` (consecutive, from the first),
        loaded and checked: a list of (keys, values) per block. ``tokens_of(i)`` gives block
        i's token ids. Stops at the first block that is missing, bad or past ``deadline``."""
        if not block_hashes:
            return []
        keys = [block_key(self.root, h) for h in block_hashes]

        def exists():
            pipe = self.client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(key)
            return pipe.execute()

        present = self._call(exists)
        if present is None:
            return []
        run = next((i for i, p in enumerate(present) if not p), len(keys))
        loaded: list = []
        while len(loaded) < run and time.monotonic() < deadline:
            batch = keys[len(loaded):min(run, len(loaded) + LOAD_BATCH)]

            def get(batch=batch):
                pipe = self.client.pipeline(transaction=False)
                for key in batch:
                    pipe.getex(key, ex=self.config.ttl)
                return pipe.execute()

            values = self._call(get)
            if values is None:
                break
            for key, value in zip(batch, values):
                block = self._check(key, value, tokens_of(len(loaded)))
                if block is None:
                    break
                loaded.append(block)
            else:
                continue
            break
        with self.lock:
            self.hits += len(loaded)
            self.misses += len(keys) - len(loaded)
            for key in keys[:len(loaded)]:
                self._remember(key)
        return loaded

    def fetch_prefix(self, request, first_block: int, block_size: int) -> list:
        """The stored blocks that continue a request's first ``first_block`` (found locally), never
        its last token's block (those logits are computed); within the request's time budget."""
        max_blocks = (request.num_tokens - 1) // block_size
        hashes = request.block_hashes[first_block:max_blocks]
        deadline = time.monotonic() + REQUEST_BUDGET_ROUND_TRIPS * self.config.timeout_ms / 1000

        def tokens_of(i: int) -> list[int]:
            start = (first_block + i) * block_size
            return request.token_ids(start, start + block_size)

        return self.fetch(hashes, tokens_of, deadline)

    def _check(self, key: bytes, value: bytes | None, token_ids: list[int]):
        if value is None:  # evicted or expired between the two round trips
            return None
        try:
            block = decode_record(value, key, token_ids, self.fingerprint, self.layout)
        except BadRecord as exc:
            logger.warning("KV store record %s is bad (%s): deleted", key[len(KEY_PREFIX):][:16].decode(), exc)
            self._count_error("corrupt")
            self._call(lambda: self.client.delete(key))
            return None
        with self.lock:
            self.bytes_read += len(value)
        return block

    def _remember(self, key: bytes) -> None:
        self.known[key] = None
        self.known.move_to_end(key)
        while len(self.known) > 65536:
            self.known.popitem(last=False)

    # ---- writes, on the writer thread -----------------------------------------------------

    def submit(self, block_hash: bytes, token_ids: list[int], keys: list[torch.Tensor],
               values: list[torch.Tensor]) -> None:
        """Queue one computed block for writing (K, V per layer: tensors of its own, on the CPU)."""
        key = block_key(self.root, block_hash)
        with self.lock:
            if key in self.known:
                return
        try:
            self.writes.put_nowait((key, token_ids, keys, values))
        except queue.Full:
            with self.lock:
                self.dropped_writes += 1

    def drop(self, count: int) -> None:
        """Blocks not even queued (the breaker is open): counted as dropped writes."""
        with self.lock:
            self.dropped_writes += count

    def _write_loop(self) -> None:
        while True:
            item = self.writes.get()
            if item is None:
                return
            batch = [item]
            while len(batch) < WRITE_BATCH:
                try:
                    nxt = self.writes.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self.writes.put(None)
                    break
                batch.append(nxt)
            if not self.breaker.allow():  # the store is away: drop without encoding anything
                self.drop(len(batch))
                continue
            records = [(key, encode_record(key, k, v, tokens, self.fingerprint)) for key, tokens, k, v in batch]

            def put():
                pipe = self.client.pipeline(transaction=False)
                for key, record in records:
                    pipe.set(key, record, nx=True, ex=self.config.ttl)
                return pipe.execute(raise_on_error=True)

            try:
                put()
            except Exception as exc:  # noqa: BLE001 - counted, and the breaker decides what comes next
                self._count_error(error_kind(exc))
                self.breaker.failure(exc)
                self.drop(len(records))
                continue
            self.breaker.success()
            with self.lock:
                self.bytes_written += sum(len(r) for _, r in records)
                for key, _ in records:
                    self._remember(key)

    def close(self) -> None:
        self.writes.put(None)
        self.writer.join(timeout=5)
        self.client.close()

    def stats(self) -> dict:
        with self.lock:
            return dict(kv_store_hits=self.hits, kv_store_misses=self.misses, kv_store_errors=dict(self.errors),
                        kv_store_bytes_read=self.bytes_read, kv_store_bytes_written=self.bytes_written,
                        kv_store_dropped_writes=self.dropped_writes, kv_store_breaker_open=self.breaker.is_open)


class StoreSource:
    """The shared KV tier as a KV source: the stored blocks that continue a prompt's prefix-cache
    hits, loaded into its new blocks; and the writer of what this engine computes."""

    def __init__(self, store: BlockStore, kv: KVCacheManager) -> None:
        self.store, self.kv = store, kv
        kv.record_published = True   # the prefix cache keeps what it publishes for write_published

    def find(self, request: Request, num_found: int) -> KVHit | None:
        if request.num_computed_tokens or not takes_cached_kv(request, self.kv):
            return None
        size = self.kv.block_size
        stored = self.store.fetch_prefix(request, num_found // size, size)
        return KVHit(len(stored) * size, payload=stored, cached=True) if stored else None

    def fill(self, request: Request, hit: KVHit, block_ids: list[int], plan: SchedulerOutput) -> None:
        plan.block_loads += zip(block_ids, hit.payload)

    def write_published(self, kv_caches: list) -> None:
        """Queue the blocks published this step (their KV is computed now) for the store."""
        published = self.kv.drain_published()
        if not published:
            return
        if self.store.breaker.is_open:  # the store is away: not worth reading the blocks out
            self.store.drop(len(published))
            return
        size = self.kv.block_size
        block_ids = [block_id for block_id, _, _ in published]
        keys, values = extract_kv(kv_caches, block_ids, len(block_ids) * size)
        keys, values = to_host(keys), to_host(values)
        for i, (_, block_hash, token_ids) in enumerate(published):
            rows = slice(i * size, (i + 1) * size)
            self.store.submit(block_hash, token_ids, [k[rows] for k in keys], [v[rows] for v in values])


def safe_url(url: str) -> str:
    """The URL without its password, for logs."""
    scheme, _, rest = url.partition("://")
    return f"{scheme}://{rest.rpartition('@')[2]}"
