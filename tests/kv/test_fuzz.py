"""Hostile bytes: the KV wire parser, the store's record parser and the message decoders reject
random, truncated, oversized and mutated inputs with their own errors, never anything else,
and never take long."""

from __future__ import annotations

import random
import time

import msgspec
import pytest
import torch

from duoserve import messages as msg
from duoserve.kv import wire
from duoserve.kv.store_record import BadRecord, block_key, decode_record, encode_record
from duoserve.sampling_params import SamplingParams

FINGERPRINT = bytes(range(32))
LAYOUT = {"dtype": "torch.float32", "block_size": 4, "num_layers": 2, "num_kv_heads": 2, "head_dim": 8}
ROUNDS = 3000


def mutations(valid: bytes, rng: random.Random):
    """Random bytes, truncations, extensions, flipped bytes and spliced copies of a valid input."""
    yield b""
    for _ in range(ROUNDS):
        choice = rng.randrange(5)
        if choice == 0:
            yield bytes(rng.randrange(256) for _ in range(rng.randrange(1, 300)))
        elif choice == 1:
            yield valid[:rng.randrange(len(valid))]
        elif choice == 2:
            yield valid + bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))
        elif choice == 3:
            data = bytearray(valid)
            for _ in range(rng.randrange(1, 8)):
                data[rng.randrange(len(data))] = rng.randrange(256)
            yield bytes(data)
        else:
            cut = rng.randrange(len(valid))
            yield valid[cut:] + valid[:cut]


def kv_tensors():
    torch.manual_seed(0)
    keys = [torch.randn(4, 2, 8) for _ in range(2)]
    values = [torch.randn(4, 2, 8) for _ in range(2)]
    return keys, values


def test_the_kv_wire_parser_rejects_hostile_frames():
    keys, values = kv_tensors()
    tokens = [1, 2, 3, 4]
    frames = [bytes(f) for f in wire.encode(keys, values, tokens, FINGERPRINT)]
    rng = random.Random(1)
    start = time.monotonic()
    accepted = 0
    for header in mutations(frames[0], rng):
        body = frames[1:] if rng.random() < 0.7 else [f[:rng.randrange(len(f) + 1)] for f in frames[1:]]
        try:
            wire.decode([header, *body], FINGERPRINT, tokens)
            accepted += 1
        except wire.KVWireError:
            pass
    assert time.monotonic() - start < 30
    # what got through had an intact header and frames (a byte flip in the header's reserved
    # fields, or a rotation that changed nothing, is all a mutation can pass with)
    assert accepted < ROUNDS // 10


def test_the_store_record_parser_rejects_hostile_values():
    keys, values = kv_tensors()
    tokens = [5, 6, 7, 8]
    key = block_key(b"r" * 32, b"h" * 32)
    record = encode_record(key, keys, values, tokens, FINGERPRINT)
    k, v = decode_record(record, key, tokens, FINGERPRINT, LAYOUT)
    assert all(torch.equal(a, b) for a, b in zip(k + v, keys + values))
    rng = random.Random(2)
    loaded = 0
    for data in mutations(record, rng):
        try:
            decode_record(data, key, tokens, FINGERPRINT, LAYOUT)
            loaded += 1
        except BadRecord:
            pass
    # the crc covers every payload byte, the key digest and magic the rest: only the two
    # reserved header fields can change and still load
    assert loaded < ROUNDS // 20


@pytest.mark.parametrize("decode", [msg.decode_at_engine, msg.decode_from_engine, msg.decode_at_prefill_peer])
def test_message_decoders_reject_hostile_bytes(decode):
    valid = msg.encode(msg.AddRequest("r1", [1, 2, 3], SamplingParams(max_tokens=4), [2], 512, 0.0))
    rng = random.Random(3)
    start = time.monotonic()
    for data in mutations(valid, rng):
        try:
            decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            pass
    assert time.monotonic() - start < 30
    huge = msgspec.msgpack.encode({"type": "AddRequest", "request_id": "x", "prompt_token_ids": [1] * 100_000})
    with pytest.raises((msgspec.DecodeError, msgspec.ValidationError)):
        decode(huge)
