"""The shared KV tier: full KV blocks in Redis, by content, for every engine of the same model.

A block's key is ``duoserve:kv:v1:`` + hex sha256(store root + the block's prefix-cache hash).
The prefix-cache hash already chains every token from the start of the sequence (and the
request's ``cache_salt``); the store root adds the model fingerprint and the KV layout (dtype,
block size, layers, KV heads, head dim). Engines of other models, dtypes, block sizes or salts
never meet a key of each other's; the same model on two hosts always does.

A value is a *block record* (docs/kv-wire-format.md)::

    magic b"DSKB" | version u16 | reserved u16 | key digest 32s | payload crc32 u32 | reserved u32
    payload: the block's KV in wire format v1 (header, then per layer K and V)

On read the key digest, the checksum and the wire header (fingerprint, layout, the block's
token hash) are checked; a record that fails is a miss, is deleted, and is never loaded. No
pickle: records are bytes in a documented layout.

Finding a prompt's stored blocks is one pipelined round trip (``EXISTS`` per block); loading
them is pipelined ``GETEX`` (which refreshes the TTL) in batches. New blocks are written by a
background thread from a bounded queue (``SET NX EX``: nobody rewrites what is there); a full
queue drops the block and counts it. Trouble with Redis never fails a request: every call has
``timeout_ms``, a request has a time budget for the tier, and a circuit breaker stops asking
after repeated errors, probing again after a cooldown (it logs when it opens and closes).
"""

from __future__ import annotations

import hashlib
import json
import logging
import queue
import struct
import threading
import time
import zlib
from collections import OrderedDict

import torch

from duoserve.config import KVStoreConfig
from duoserve.kv import wire

logger = logging.getLogger(__name__)

KEY_PREFIX = b"duoserve:kv:v1:"
RECORD_MAGIC = b"DSKB"
RECORD_VERSION = 1
_RECORD = struct.Struct("<4sHH32sII")
LOAD_BATCH = 16          # blocks per pipelined GETEX
REQUEST_BUDGET_ROUND_TRIPS = 8  # a request's time with the tier: this many timeouts, then it computes
WRITE_BATCH = 32         # blocks per pipelined SET


def store_root(fingerprint: bytes, layout: dict) -> bytes:
    """What every key of this engine is derived from: the model and the KV layout."""
    return hashlib.sha256(fingerprint + json.dumps(layout, sort_keys=True).encode()).digest()


def block_key(root: bytes, block_hash: bytes) -> bytes:
    return KEY_PREFIX + hashlib.sha256(root + block_hash).hexdigest().encode()


def encode_record(key: bytes, keys: list[torch.Tensor], values: list[torch.Tensor], token_ids: list[int],
                  fingerprint: bytes) -> bytes:
    """A block record: per layer K and V [block_size, num_kv_heads, head_dim] of ``token_ids``."""
    payload = b"".join(wire.encode(keys, values, token_ids, fingerprint))  # one copy of the KV
    digest = hashlib.sha256(key).digest()
    return _RECORD.pack(RECORD_MAGIC, RECORD_VERSION, 0, digest, zlib.crc32(payload), 0) + payload


class BadRecord(Exception):
    """A stored value that must not be loaded (the message says why)."""


def decode_record(data: bytes, key: bytes, token_ids: list[int], fingerprint: bytes,
                  layout: dict) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Check a record against the key it was read under and the block it should hold; its K, V."""
    if len(data) < _RECORD.size + wire.HEADER_SIZE:
        raise BadRecord(f"{len(data)} bytes is shorter than a record header")
    magic, version, _, digest, crc, _ = _RECORD.unpack_from(data)
    if magic != RECORD_MAGIC or version != RECORD_VERSION:
        raise BadRecord(f"not a version {RECORD_VERSION} block record (magic {magic!r}, version {version})")
    if digest != hashlib.sha256(key).digest():
        raise BadRecord("the record belongs to another key")
    payload = memoryview(data)[_RECORD.size:]
    if zlib.crc32(payload) != crc:
        raise BadRecord("the payload's checksum does not match")
    try:
        header = wire.decode_header(payload, fingerprint)
    except wire.KVWireError as exc:
        raise BadRecord(str(exc)) from None
    got = {"dtype": str(header.dtype), "num_layers": header.num_layers, "num_kv_heads": header.num_kv_heads,
           "head_dim": header.head_dim, "block_size": header.num_tokens}
    want = {name: layout[name] for name in got}
    if got != want:
        raise BadRecord(f"the record's layout {got} is not this engine's {want}")
    if header.token_hash != wire.token_hash(token_ids):
        raise BadRecord("the record holds other tokens")
    if len(payload) != wire.HEADER_SIZE + header.payload_size:
        raise BadRecord(f"payload of {len(payload)} bytes, expected {wire.HEADER_SIZE + header.payload_size}")
    shape = (header.num_tokens, header.num_kv_heads, header.head_dim)
    tensors = torch.frombuffer(bytearray(payload[wire.HEADER_SIZE:]), dtype=header.dtype).view(
        2 * header.num_layers, *shape)
    return list(tensors[0::2]), list(tensors[1::2])


class CircuitBreaker:
    """Closed: calls go through. ``errors`` failures in a row open it: no calls for ``cooldown``
    seconds, then one probe; its success closes it, its failure opens it again."""

    def __init__(self, errors: int, cooldown: float, name: str) -> None:
        self.threshold, self.cooldown, self.name = errors, cooldown, name
        self.failures = 0
        self.open_until: float | None = None
        self.lock = threading.Lock()

    @property
    def is_open(self) -> bool:
        return self.open_until is not None

    def allow(self) -> bool:
        with self.lock:
            if self.open_until is None:
                return True
            if time.monotonic() >= self.open_until:  # half-open: this call is the probe
                self.open_until = time.monotonic() + self.cooldown
                return True
            return False

    def success(self) -> None:
        with self.lock:
            if self.open_until is not None:
                logger.info("%s answers again: circuit breaker closed", self.name)
            self.failures, self.open_until = 0, None

    def failure(self, error: Exception) -> None:
        with self.lock:
            self.failures += 1
            if self.failures >= self.threshold and self.open_until is None:
                logger.warning("%s failed %d times in a row (%s): circuit breaker open, requests compute "
                               "without it; probing again in %.1f s", self.name, self.failures,
                               str(error).strip() or type(error).__name__, self.cooldown)
            if self.failures >= self.threshold:
                self.open_until = time.monotonic() + self.cooldown


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
        self.hits = self.misses = self.bytes_read = self.bytes_written = self.dropped_writes = 0
        self.errors: dict[str, int] = {}
        self.known: OrderedDict[bytes, None] = OrderedDict()   # keys seen in the store (not written again)
        self.writes: queue.Queue = queue.Queue(maxsize=config.write_queue)
        self.lock = threading.Lock()
        self.writer = threading.Thread(target=self._write_loop, name="kv-store-writer", daemon=True)
        self.writer.start()

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


def safe_url(url: str) -> str:
    """The URL without its password, for logs."""
    scheme, _, rest = url.partition("://")
    return f"{scheme}://{rest.rpartition('@')[2]}"
