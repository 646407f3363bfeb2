"""Block records of the shared KV store: keys, and values that are checked before they are loaded.

A block's key is ``duoserve:kv:v1:`` + hex sha256(store root + the block's prefix-cache hash).
The prefix-cache hash already chains every token from the start of the sequence (and the
request's ``cache_salt``); the store root adds the model fingerprint and the KV layout (dtype,
block size, layers, KV heads, head dim). A value (docs/kv-wire-format.md)::

    magic b"DSKB" | version u16 | reserved u16 | key digest 32s | payload crc32 u32 | reserved u32
    payload: the block's KV in wire format v1 (header, then per layer K and V)

On read the key digest, the checksum and the wire header (fingerprint, layout, the block's
token hash) are checked. No pickle: records are bytes in a documented layout.
"""

from __future__ import annotations

import hashlib
import json
import struct
import zlib

import torch

from duoserve.kv import wire

KEY_PREFIX = b"duoserve:kv:v1:"
RECORD_MAGIC = b"DSKB"
RECORD_VERSION = 1
_RECORD = struct.Struct("<4sHH32sII")


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
