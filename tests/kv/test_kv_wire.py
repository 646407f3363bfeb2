"""KV wire format v1, re-blocking between caches of different block sizes, model fingerprints."""

from __future__ import annotations

import struct

import pytest
import torch

from duoserve.config import ModelConfig
from duoserve.kv import wire
from duoserve.kv.reblock import extract_kv, insert_kv
from duoserve.model.attention import AttentionMetadata
from duoserve.model.fingerprint import describe, fingerprint
from duoserve.worker.backends import load_model

FP = bytes(range(32))
TOKENS = [5, 9, 200, 17, 3, 3, 80]


def _kv(dtype=torch.float32, layers=3, tokens=len(TOKENS)):
    torch.manual_seed(0)
    keys = [torch.randn(tokens, 2, 8).to(dtype) for _ in range(layers)]
    values = [torch.randn(tokens, 2, 8).to(dtype) for _ in range(layers)]
    return keys, values


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_is_exact(dtype):
    keys, values = _kv(dtype)
    frames = wire.encode(keys, values, TOKENS, FP)
    assert len(frames[0]) == wire.HEADER_SIZE == 96
    header, k2, v2 = wire.decode([bytes(f) for f in frames], FP, TOKENS)
    assert (header.num_layers, header.num_kv_heads, header.head_dim, header.num_tokens) == (3, 2, 8, 7)
    assert header.dtype == dtype
    for a, b in zip(keys + values, k2 + v2):
        assert torch.equal(a, b)


def test_receiver_converts_dtype():
    keys, values = _kv(torch.float32)
    _, k2, _ = wire.decode(wire.encode(keys, values, TOKENS, FP), FP, dtype=torch.bfloat16)
    assert k2[0].dtype == torch.bfloat16 and torch.equal(k2[0], keys[0].to(torch.bfloat16))


def test_refusals_are_clear():
    keys, values = _kv()
    frames = [bytes(f) for f in wire.encode(keys, values, TOKENS, FP)]
    corrupt = bytearray(frames[0])
    corrupt[60] ^= 0xFF  # inside num_tokens
    with pytest.raises(wire.KVWireError, match="KV header is corrupted: its checksum does not match"):
        wire.decode([bytes(corrupt)] + frames[1:], FP)
    newer = bytearray(frames[0])
    newer[4:6] = struct.pack("<H", 2)
    with pytest.raises(wire.KVWireError, match="KV wire format version 2 is not supported; this engine reads "
                                               "version 1"):
        wire.decode([bytes(newer)] + frames[1:], FP)
    other = bytes(reversed(FP))
    with pytest.raises(wire.KVWireError) as err:
        wire.decode(frames, other)
    assert str(err.value) == (f"KV comes from another model: fingerprint {FP.hex()[:16]}, this engine's is "
                              f"{other.hex()[:16]}")
    with pytest.raises(wire.KVWireError, match="not a KV transfer: magic b'XXXX'"):
        wire.decode([b"XXXX" + frames[0][4:]] + frames[1:], FP)
    with pytest.raises(wire.KVWireError, match="token-id hash does not match"):
        wire.decode(frames, FP, TOKENS[:-1] + [4])
    with pytest.raises(wire.KVWireError, match="KV frame of 10 bytes, expected 448"):
        wire.decode(frames[:1] + [b"x" * 10] + frames[2:], FP)
    with pytest.raises(wire.KVWireError, match="KV header is 3 bytes, expected 96"):
        wire.decode([b"abc"], FP)


def _caches(model, num_blocks, block_size):
    arch = model.arch
    shape = (num_blocks, block_size, arch.num_kv_heads, arch.head_dim)
    return [(torch.zeros(shape), torch.zeros(shape)) for _ in range(arch.num_layers)]


def _step(model, caches, token_ids, start, block_ids, block_size):
    """Run tokens [start, len) of a sequence over the given caches; logits of its last token."""
    n = len(token_ids)
    meta = AttentionMetadata.build([n - start], [n], [block_ids], block_size)
    hidden = model(torch.tensor(token_ids[start:]), torch.arange(start, n), caches, meta)
    return model.compute_logits(hidden[-1:])[0]


def test_prefill_block16_then_decode_block32_is_identical(tiny_dir):
    model = load_model(ModelConfig(model=str(tiny_dir(kind="qwen3")), dtype="float32")).model
    prompt = [7, 100, 3, 55, 200, 9, 1, 4, 88, 12, 30, 31, 32, 33, 34, 35, 36, 37, 250]  # 19 tokens
    with torch.no_grad():
        # reference: one cache, block size 16, greedy for 6 tokens
        ref_caches, ref_blocks = _caches(model, 8, 16), [5, 2]
        seq = list(prompt)
        logits = _step(model, ref_caches, seq, 0, ref_blocks, 16)
        want = []
        for _ in range(6):
            want.append(int(logits.argmax()))
            seq.append(want[-1])
            logits = _step(model, ref_caches, seq, len(seq) - 1, ref_blocks, 16)
        # prefill engine: block size 16, sends the prompt's KV and its first token
        pre_caches, pre_blocks = _caches(model, 8, 16), [3, 6]
        first = int(_step(model, pre_caches, prompt, 0, pre_blocks, 16).argmax())
        frames = wire.encode(*extract_kv(pre_caches, pre_blocks, len(prompt)), prompt, FP)
        # decode engine: block size 32, other block ids
        _, keys, values = wire.decode([bytes(f) for f in frames], FP, prompt)
        dec_caches, dec_blocks = _caches(model, 4, 32), [1]
        insert_kv(dec_caches, dec_blocks, keys, values)
        seq, got = prompt + [first], [first]
        for _ in range(5):
            got.append(int(_step(model, dec_caches, seq, len(seq) - 1, dec_blocks, 32).argmax()))
            seq.append(got[-1])
    assert got == want


def test_insert_refuses_mismatched_shapes():
    caches = [(torch.zeros(2, 4, 2, 8), torch.zeros(2, 4, 2, 8))]
    with pytest.raises(ValueError, match=r"KV for 2 layers, but this cache has 1"):
        insert_kv(caches, [0], [torch.zeros(3, 2, 8)] * 2, [torch.zeros(3, 2, 8)] * 2)
    with pytest.raises(ValueError, match=r"1 blocks of 4 cannot hold 6 tokens"):
        insert_kv(caches, [0], [torch.zeros(6, 2, 8)], [torch.zeros(6, 2, 8)])


def test_fingerprint_covers_model_not_dtype(tiny_dir, default_model):
    llama = load_model(ModelConfig(model=str(tiny_dir(kind="llama")), dtype="float32"))
    llama_bf16 = load_model(ModelConfig(model=str(tiny_dir(kind="llama")), dtype="bfloat16"))
    qwen = load_model(ModelConfig(model=str(tiny_dir(kind="qwen2")), dtype="float32"))
    a = describe(llama.arch, llama.tokenizer, llama.path)
    assert fingerprint(a) == fingerprint(describe(llama_bf16.arch, llama_bf16.tokenizer, llama_bf16.path))
    b = describe(qwen.arch, qwen.tokenizer, qwen.path)
    assert fingerprint(a) != fingerprint(b)
    assert a["architecture"] == "LlamaForCausalLM" and b["qkv_bias"] is True
    smol = describe(default_model.arch, default_model.tokenizer, default_model.path)
    assert smol["num_layers"] == 30 and smol["tokenizer"] is not None and len(smol["weights"]) == 64
