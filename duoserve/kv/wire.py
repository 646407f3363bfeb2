"""KV wire format v1: one request's keys and values for a token range, independent of block size.

Layout (little-endian), documented in docs/kv-wire-format.md::

    header (96 bytes)
      magic        4s   b"DSKV"
      version      u16  1
      dtype        u8   0 float32, 1 bfloat16, 2 float16
      reserved     u8   0
      fingerprint  32s  the model fingerprint of the sender
      num_layers   u32
      num_kv_heads u32
      head_dim     u32
      num_tokens   u32
      token_hash   32s  sha256 of the token ids as int32
      header_crc   u32  crc32 of the 88 bytes above
      reserved     u32  0
    payload
      for each layer: K [num_tokens, num_kv_heads, head_dim], then V (same shape)

The receiver checks magic, version, checksum, fingerprint and sizes before it trusts a
byte of the payload, then converts to its own KV dtype and block size.
"""

from __future__ import annotations

import hashlib
import struct
import zlib
from dataclasses import dataclass

import torch

from duoserve.errors import DuoserveError

MAGIC = b"DSKV"
VERSION = 1
_HEAD = struct.Struct("<4sHBB32sIIII32s")
_TAIL = struct.Struct("<II")
HEADER_SIZE = _HEAD.size + _TAIL.size
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}


class KVWireError(DuoserveError):
    """A KV transfer could not be read: the message says what is wrong and what was expected."""


def token_hash(token_ids: list[int]) -> bytes:
    return hashlib.sha256(struct.pack(f"<{len(token_ids)}i", *token_ids)).digest()


@dataclass(frozen=True)
class KVHeader:
    fingerprint: bytes
    dtype: torch.dtype
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_tokens: int
    token_hash: bytes

    @property
    def payload_size(self) -> int:
        element = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_tokens * self.num_kv_heads * self.head_dim * element

    def pack(self) -> bytes:
        head = _HEAD.pack(MAGIC, VERSION, DTYPE_CODES[self.dtype], 0, self.fingerprint, self.num_layers,
                          self.num_kv_heads, self.head_dim, self.num_tokens, self.token_hash)
        return head + _TAIL.pack(zlib.crc32(head), 0)


def encode(keys: list[torch.Tensor], values: list[torch.Tensor], token_ids: list[int],
           fingerprint: bytes) -> list[bytes | memoryview]:
    """Frames to send: the header, then each layer's K and V as zero-copy views of CPU tensors.

    keys/values: per layer [num_tokens, num_kv_heads, head_dim], all of one dtype.
    """
    if len(fingerprint) != 32:
        raise ValueError(f"a fingerprint is 32 bytes, got {len(fingerprint)}")
    num_tokens, num_kv_heads, head_dim = keys[0].shape
    if num_tokens != len(token_ids):
        raise ValueError(f"{num_tokens} tokens of KV but {len(token_ids)} token ids")
    header = KVHeader(fingerprint, keys[0].dtype, len(keys), num_kv_heads, head_dim, num_tokens,
                      token_hash(token_ids))
    frames: list[bytes | memoryview] = [header.pack()]
    for k, v in zip(keys, values):
        for t in (k, v):
            t = t.detach().to("cpu").contiguous()
            frames.append(memoryview(t.view(torch.uint8).numpy()).cast("B"))
    return frames


def decode_header(data: bytes | memoryview, expected_fingerprint: bytes | None = None) -> KVHeader:
    if len(data) < HEADER_SIZE:
        raise KVWireError(f"KV header is {len(data)} bytes, expected {HEADER_SIZE}")
    head = bytes(data[:_HEAD.size])
    magic, version, dtype_code, _, fingerprint, layers, heads, dim, tokens, thash = _HEAD.unpack(head)
    crc, _ = _TAIL.unpack(bytes(data[_HEAD.size:HEADER_SIZE]))
    if magic != MAGIC:
        raise KVWireError(f"not a KV transfer: magic {magic!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise KVWireError(f"KV wire format version {version} is not supported; this engine reads version {VERSION}")
    if zlib.crc32(head) != crc:
        raise KVWireError("KV header is corrupted: its checksum does not match")
    if dtype_code not in CODE_DTYPES:
        raise KVWireError(f"unknown KV dtype code {dtype_code}; known: {sorted(CODE_DTYPES)}")
    if expected_fingerprint is not None and fingerprint != expected_fingerprint:
        raise KVWireError(f"KV comes from another model: fingerprint {fingerprint.hex()[:16]}, "
                          f"this engine's is {expected_fingerprint.hex()[:16]}")
    return KVHeader(fingerprint, CODE_DTYPES[dtype_code], layers, heads, dim, tokens, thash)


def decode(frames: list[bytes | memoryview], expected_fingerprint: bytes, token_ids: list[int] | None = None,
           dtype: torch.dtype | None = None) -> tuple[KVHeader, list[torch.Tensor], list[torch.Tensor]]:
    """Check and read a transfer; K and V per layer [num_tokens, num_kv_heads, head_dim] in ``dtype``."""
    header = decode_header(frames[0], expected_fingerprint)   # refuses a short one
    if len(frames[0]) != HEADER_SIZE:
        raise KVWireError(f"KV header frame is {len(frames[0])} bytes, expected {HEADER_SIZE}")
    if token_ids is not None and token_hash(token_ids) != header.token_hash:
        raise KVWireError("KV is for other tokens: the token-id hash does not match the request's prompt")
    body = frames[1:]
    if len(body) != 2 * header.num_layers:
        raise KVWireError(f"KV transfer has {len(body)} tensor frames, expected {2 * header.num_layers}")
    shape = (header.num_tokens, header.num_kv_heads, header.head_dim)
    per = header.payload_size // (2 * header.num_layers)
    tensors = []
    for frame in body:
        if len(frame) != per:
            raise KVWireError(f"KV frame of {len(frame)} bytes, expected {per}")
        t = torch.frombuffer(bytearray(frame), dtype=header.dtype).view(shape)
        tensors.append(t.to(dtype) if dtype is not None else t)
    return header, tensors[0::2], tensors[1::2]
