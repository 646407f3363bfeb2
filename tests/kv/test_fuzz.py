"""Hostile bytes: the KV wire parser, the store's record parser and the message decoders reject
random, truncated, oversized and mutated inputs with their own errors, never anything else.
What a parser accepts is exactly what its format leaves unchecked (reserved fields), and the
work is bounded by the number of rounds, not by a clock."""

from __future__ import annotations

import random

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


def differs_only_in(data: bytes, valid: bytes, free: range | set[int]) -> bool:
    """``data`` is ``valid`` but for the bytes at the offsets in ``free``."""
    return len(data) == len(valid) and all(a == b for i, (a, b) in enumerate(zip(data, valid)) if i not in free)


def test_the_kv_wire_parser_rejects_hostile_frames():
    keys, values = kv_tensors()
    tokens = [1, 2, 3, 4]
    frames = [bytes(f) for f in wire.encode(keys, values, tokens, FINGERPRINT)]
    # the header's last field (reserved u32) is the only one its checksum leaves out
    free = range(wire.HEADER_SIZE - 4, wire.HEADER_SIZE)
    rng = random.Random(1)
    num_accepted = 0
    for header in mutations(frames[0], rng):
        body = frames[1:] if rng.random() < 0.7 else [f[:rng.randrange(len(f) + 1)] for f in frames[1:]]
        intact = differs_only_in(header, frames[0], free) and body == frames[1:]
        try:
            _, k, v = wire.decode([header, *body], FINGERPRINT, tokens)
        except wire.KVWireError:
            assert not intact, f"an intact transfer was refused: header {header.hex()}"
            continue
        assert intact, f"a damaged transfer was accepted: header {header.hex()}"
        assert all(torch.equal(a, b) for a, b in zip(k + v, keys + values))
        num_accepted += 1
    assert num_accepted > 0, "the mutations include unchanged transfers: the parser must take those"


def test_the_store_record_parser_rejects_hostile_values():
    keys, values = kv_tensors()
    tokens = [5, 6, 7, 8]
    key = block_key(b"r" * 32, b"h" * 32)
    record = encode_record(key, keys, values, tokens, FINGERPRINT)
    k, v = decode_record(record, key, tokens, FINGERPRINT, LAYOUT)
    assert all(torch.equal(a, b) for a, b in zip(k + v, keys + values))
    # the crc covers every payload byte, the key digest and magic the rest: only the two
    # reserved fields of the record header (u16 at 6, u32 at 44) can change and still load
    free = {6, 7, 44, 45, 46, 47}
    rng = random.Random(2)
    num_loaded = 0
    for data in mutations(record, rng):
        intact = differs_only_in(data, record, free)
        try:
            k, v = decode_record(data, key, tokens, FINGERPRINT, LAYOUT)
        except BadRecord:
            assert not intact, f"an intact record was refused: {data[:48].hex()}"
            continue
        assert intact, f"a damaged record was loaded: {data[:48].hex()}"
        assert all(torch.equal(a, b) for a, b in zip(k + v, keys + values))
        num_loaded += 1
    assert num_loaded > 0, "the mutations include unchanged records: the parser must load those"


@pytest.mark.parametrize("decode", [msg.decode_at_engine, msg.decode_from_engine, msg.decode_at_prefill_peer])
def test_message_decoders_reject_hostile_bytes(decode):
    valid = msg.encode(msg.AddRequest("r1", [1, 2, 3], SamplingParams(max_tokens=4), [2], 512, 0.0))
    rng = random.Random(3)
    for data in mutations(valid, rng):
        try:
            decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            pass
    huge = msgspec.msgpack.encode({"type": "AddRequest", "request_id": "x", "prompt_token_ids": [1] * 100_000})
    with pytest.raises((msgspec.DecodeError, msgspec.ValidationError)):
        decode(huge)
