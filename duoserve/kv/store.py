"""The KV tiers beyond the prefix cache: full KV blocks by content, in Redis (shared by every engine
of the same model) and on disk (``duoserve.kv.disk_tier``: kept across restarts).

Keys and values are block records (``duoserve.kv.store_record``, docs/kv-wire-format.md):
engines of other models, dtypes, block sizes or salts never meet a key of each other's; the
same model on two hosts always does. A record that fails its checks on read is a miss, is
deleted, and is never loaded.

A tier answers ``exists``, ``get``, ``put`` and ``delete`` for keys (``RedisTier``, ``DiskTier``);
``BlockStore`` does the rest the same for both. Finding a prompt's stored blocks is one round trip
(in Redis one pipelined ``EXISTS`` per block); loading them is done in batches (``GETEX``, which
refreshes the TTL). New blocks are written by a background thread from a bounded queue (nobody
rewrites what is there); a full queue drops the block and counts it. Trouble with a tier never
fails a request: a request has a time budget for the tier (``timeout_ms`` a round trip; Redis's
calls time out at it, the disk's are checked between batches), and a
circuit breaker (``duoserve.kv.breaker``) stops asking after repeated errors, probing again after
a cooldown.

``StoreSource`` is the engine's side: one of the KV sources asked at admission
(``duoserve.core.kv_sources``), right after the prefix cache, asking its tiers in order (disk,
then Redis: each continues where the one before stopped), and the writer of the blocks the
prefix cache publishes once their KV is computed, to every tier.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict

import torch

from duoserve.config import KVDiskConfig, KVStoreConfig
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
# a request's time with the tier: a timeout for each round trip its blocks take, and this many more,
# up to a maximum; past it, it computes the rest (a block loads in a fraction of what computing it
# costs, so a tier that answers in time is not cut short, and one that does not costs a bounded wait)
REQUEST_BUDGET_SPARE_ROUND_TRIPS = 2
REQUEST_BUDGET_MAX_ROUND_TRIPS = 32   # and never more: the engine's other requests wait meanwhile
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


class RedisTier:
    """Block records in Redis, each with a TTL its writes and hits refresh."""
    stats_prefix = "kv_store"
    required_by = "--kv-store-required"

    def __init__(self, config: KVStoreConfig) -> None:
        import redis

        seconds = config.timeout_ms / 1000
        self.ttl = config.ttl
        self.what = f"the KV store {safe_url(config.url)}"
        self.client = redis.Redis.from_url(config.url, socket_timeout=seconds, socket_connect_timeout=seconds,
                                           retry_on_timeout=False)

    def ping(self) -> None:
        self.client.ping()

    def exists(self, keys: list[bytes]) -> list[bool]:
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.exists(key)
        return [bool(n) for n in pipe.execute()]

    def get(self, keys: list[bytes]) -> list[bytes | None]:
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.getex(key, ex=self.ttl)
        return pipe.execute()

    def put(self, records: list[tuple[bytes, bytes]]) -> None:
        pipe = self.client.pipeline(transaction=False)
        for key, record in records:
            pipe.set(key, record, nx=True, ex=self.ttl)
        pipe.execute(raise_on_error=True)

    def delete(self, key: bytes) -> None:
        self.client.delete(key)

    def error_kind(self, error: Exception) -> str:
        return error_kind(error)

    def stats(self) -> dict:
        return {}

    def close(self) -> None:
        self.client.close()


class BlockStore:
    """The engine's side of one tier: ``find``/``load`` on the engine thread, ``submit`` queues
    writes for a background thread."""

    def __init__(self, config: KVStoreConfig | KVDiskConfig, tier, fingerprint: bytes, layout: dict) -> None:
        self.config, self.tier, self.fingerprint, self.layout = config, tier, fingerprint, layout
        self.prefix = tier.stats_prefix
        self.root = store_root(fingerprint, layout)
        self.breaker = CircuitBreaker(config.breaker_errors, config.breaker_cooldown, tier.what)
        self._check_answers()
        self.hits = self.misses = self.bytes_read = self.bytes_written = self.dropped_writes = 0
        self.errors: dict[str, int] = {}
        self.known: OrderedDict[bytes, None] = OrderedDict()   # keys seen in the store (not written again)
        self.writes: queue.Queue = queue.Queue(maxsize=config.write_queue)
        self.lock = threading.Lock()
        self.writer = threading.Thread(target=self._write_loop, name=f"{self.prefix}-writer", daemon=True)
        self.writer.start()

    def _check_answers(self) -> None:
        """One PING at start: a store that does not answer is a warning naming it (requests
        compute without it, and the breaker retries it), or with ``required`` a refusal to start."""
        try:
            self.tier.ping()
        except Exception as exc:  # noqa: BLE001 - any failure to answer is reported the same way
            what = f"{self.tier.what} does not answer ({type(exc).__name__}: {exc})"
            if self.config.required:
                raise KVStoreUnavailable(f"{what}; {self.tier.required_by}: not starting") from exc
            logger.warning("%s: serving without it until it does", what)

    # ---- reads, on the engine thread ------------------------------------------------------

    def _call(self, fn):
        """Run one round trip under the breaker; None when skipped or failed (counted)."""
        if not self.breaker.allow():
            return None
        try:
            result = fn()
        except Exception as exc:  # noqa: BLE001 - a tier's trouble never reaches a request
            self._count_error(self.tier.error_kind(exc))
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
        present = self._call(lambda: self.tier.exists(keys))
        if present is None:
            return []
        run = next((i for i, p in enumerate(present) if not p), len(keys))
        if run < len(keys):   # gone (evicted, expired): written again when computed again
            with self.lock:
                self.known.pop(keys[run], None)
        loaded: list = []
        while len(loaded) < run and time.monotonic() < deadline:
            batch = keys[len(loaded):min(run, len(loaded) + LOAD_BATCH)]
            values = self._call(lambda batch=batch: self.tier.get(batch))
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
        round_trips = min(1 + -(-len(hashes) // LOAD_BATCH) + REQUEST_BUDGET_SPARE_ROUND_TRIPS,   # find, load, spare
                          REQUEST_BUDGET_MAX_ROUND_TRIPS)
        deadline = time.monotonic() + round_trips * self.config.timeout_ms / 1000

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
            logger.warning("%s: record %s is bad (%s): deleted", self.tier.what, key[len(KEY_PREFIX):][:16].decode(),
                           exc)
            self._count_error("corrupt")
            self._call(lambda: self.tier.delete(key))
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

    def knows(self, block_hash: bytes) -> bool:
        """Whether the tier holds this block already, as far as this engine saw (loaded or written)."""
        with self.lock:
            return block_key(self.root, block_hash) in self.known

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
            try:
                self.tier.put(records)
            except Exception as exc:  # noqa: BLE001 - counted, and the breaker decides what comes next
                self._count_error(self.tier.error_kind(exc))
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
        self.tier.close()

    def stats(self) -> dict:
        """Its counters under its tier's names (``kv_store_hits``, ``kv_disk_hits``, ...)."""
        with self.lock:
            counts = dict(hits=self.hits, misses=self.misses, errors=dict(self.errors), bytes_read=self.bytes_read,
                          bytes_written=self.bytes_written, dropped_writes=self.dropped_writes,
                          breaker_open=self.breaker.is_open)
        return {**{f"{self.prefix}_{name}": value for name, value in counts.items()}, **self.tier.stats()}


class StoreSource:
    """The KV tiers as a KV source: the stored blocks that continue a prompt's prefix-cache hits,
    from each tier in turn (disk, then Redis), loaded into its new blocks; and the writer of what
    this engine computes, to every tier."""

    def __init__(self, stores: list[BlockStore], kv: KVCacheManager) -> None:
        self.stores, self.kv = stores, kv
        kv.record_published = True   # the prefix cache keeps what it publishes for write_published

    def tier(self, prefix: str) -> BlockStore | None:
        """The store of one tier ("kv_store": Redis, "kv_disk"), if the engine has it."""
        return next((store for store in self.stores if store.prefix == prefix), None)

    def find(self, request: Request, num_found: int) -> KVHit | None:
        if request.num_computed_tokens or not takes_cached_kv(request, self.kv):
            return None
        size = self.kv.block_size
        stored: list = []
        for store in self.stores:
            stored += store.fetch_prefix(request, num_found // size + len(stored), size)
        return KVHit(len(stored) * size, payload=stored, cached=True) if stored else None

    def fill(self, request: Request, hit: KVHit, block_ids: list[int], plan: SchedulerOutput) -> None:
        plan.block_loads += zip(block_ids, hit.payload)

    def write_published(self, kv_caches: list) -> None:
        """Queue the blocks published this step (their KV is computed now) for the store."""
        published = self.kv.drain_published()
        if not published:
            return
        # blocks loaded from the tiers are published again as they are cached: not read out for nothing
        published = [p for p in published if not all(store.knows(p[1]) for store in self.stores)]
        if not published:
            return
        open_stores = []
        for store in self.stores:
            if store.breaker.is_open:  # the tier is away: not worth reading the blocks out for it
                store.drop(len(published))
            else:
                open_stores.append(store)
        if not open_stores:
            return
        size = self.kv.block_size
        block_ids = [block_id for block_id, _, _ in published]
        keys, values = extract_kv(kv_caches, block_ids, len(block_ids) * size)
        keys, values = to_host(keys), to_host(values)
        for i, (_, block_hash, token_ids) in enumerate(published):
            rows = slice(i * size, (i + 1) * size)
            for store in open_stores:
                store.submit(block_hash, token_ids, [k[rows] for k in keys], [v[rows] for v in values])


def safe_url(url: str) -> str:
    """The URL without its password, for logs."""
    scheme, _, rest = url.partition("://")
    return f"{scheme}://{rest.rpartition('@')[2]}"
