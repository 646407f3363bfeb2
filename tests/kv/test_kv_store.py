"""The shared KV store against a real redis-server: hits across engines and processes, isolation,
records that fail their checks, TTLs, and Redis trouble that never fails a request."""

from __future__ import annotations

import logging
import os
import random
import signal
import socket
import time

import httpx
import pytest

from duoserve import LLM, SamplingParams
from duoserve.config import CacheConfig, EngineConfig, KVStoreConfig, ModelConfig
from duoserve.engine.builder import build_engine
from duoserve.kv.store_record import KEY_PREFIX, _RECORD
from tests.helpers import assert_pool_whole, wait_for_store_writes

PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
BLOCK = 16


def long_prompt(seed: int = 0, length: int = 150) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(length)]


def engine(path, url: str | None, dtype: str = "float32", block_size: int = BLOCK, **store) -> LLM:
    kv_store = KVStoreConfig(url, **store) if url else None
    config = EngineConfig(model=ModelConfig(model=str(path), dtype=dtype),
                          cache=CacheConfig(block_size=block_size, kv_cache_memory=0.01), kv_store=kv_store)
    return LLM.from_engine(build_engine(config))


def settle(llm: LLM, timeout: float = 5.0) -> None:
    """Wait until the engine's store writer has written everything queued."""
    wait_for_store_writes(llm.engine, timeout=timeout)


def stored_keys(redis_server) -> list[bytes]:
    return sorted(redis_server.client().keys(KEY_PREFIX + b"*"))


def test_a_second_engine_computes_only_what_the_store_lacks(tiny_dir, redis_server):
    path = tiny_dir(kind="llama")
    prompt = long_prompt()                      # 150 tokens: 9 full blocks, the last token computed
    want = LLM(str(path), dtype="float32").generate([prompt], PARAMS, use_tqdm=False)[0].outputs[0].token_ids
    first = engine(path, redis_server.url)
    (out,) = first.generate([prompt], PARAMS, use_tqdm=False)
    assert out.outputs[0].token_ids == want
    settle(first)
    assert len(stored_keys(redis_server)) == (150 + 12 - 1) // BLOCK  # every full block, outputs too
    second = engine(path, redis_server.url)
    (again,) = second.generate([prompt], PARAMS, use_tqdm=False)
    assert again.outputs[0].token_ids == want
    stats = second.engine.kv_store.stats()
    assert stats["kv_store_hits"] == 9 and stats["kv_store_misses"] == 0
    assert again.num_cached_tokens == 9 * BLOCK
    assert second.engine.measures.num_prompt_tokens == 150 - 9 * BLOCK  # only the uncached tokens were computed
    assert_pool_whole(second)


@pytest.mark.parametrize("change", ["model", "dtype", "block_size", "salt"])
def test_engines_that_differ_never_share_blocks(tiny_dir, redis_server, change):
    path = tiny_dir(kind="llama")
    prompt = long_prompt(1)
    writer = engine(path, redis_server.url)
    writer.generate([prompt], PARAMS, use_tqdm=False)
    settle(writer)
    params = PARAMS
    if change == "model":
        reader = engine(tiny_dir(kind="llama", seed=5), redis_server.url)
    elif change == "dtype":
        reader = engine(path, redis_server.url, dtype="bfloat16")
    elif change == "block_size":
        reader = engine(path, redis_server.url, block_size=32)
    else:
        reader = engine(path, redis_server.url)
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, cache_salt="tenant-b")
    reader.generate([prompt], params, use_tqdm=False)
    assert reader.engine.kv_store.stats()["kv_store_hits"] == 0
    # and the salted writer's blocks serve only the same salt
    if change == "salt":
        settle(reader)
        same_salt = engine(path, redis_server.url)
        same_salt.generate([prompt], params, use_tqdm=False)
        assert same_salt.engine.kv_store.stats()["kv_store_hits"] == 9


@pytest.mark.parametrize("damage", ["payload", "checksum", "other_key"])
def test_a_record_that_fails_its_checks_is_a_miss_and_is_deleted(tiny_dir, redis_server, damage, caplog):
    path = tiny_dir(kind="llama")
    prompt = long_prompt(2)
    want = LLM(str(path), dtype="float32").generate([prompt], PARAMS, use_tqdm=False)[0].outputs[0].token_ids
    writer = engine(path, redis_server.url)
    writer.generate([prompt], PARAMS, use_tqdm=False)
    settle(writer)
    client = redis_server.client()
    # the prompt's third block: find its key through an engine's own hashing
    reader = engine(path, redis_server.url)
    from duoserve.core.request import Request
    from duoserve.kv.store_record import block_key

    probe = Request("probe", prompt, PARAMS)
    reader.engine.kv._extend_hashes(probe, 9 * BLOCK)
    key = block_key(reader.engine.kv_store.root, probe.block_hashes[2])
    record = bytearray(client.get(key))
    if damage == "payload":
        record[-5] ^= 0xFF
    elif damage == "checksum":
        record[_RECORD.size - 8] ^= 0xFF     # the payload crc32
    else:
        record = bytearray(client.get(block_key(reader.engine.kv_store.root, probe.block_hashes[3])))
    client.set(key, bytes(record))
    with caplog.at_level(logging.WARNING, logger="duoserve.kv"):
        (out,) = reader.generate([prompt], PARAMS, use_tqdm=False)
    assert out.outputs[0].token_ids == want
    stats = reader.engine.kv_store.stats()
    assert stats["kv_store_hits"] == 2 and stats["kv_store_errors"] == {"corrupt": 1}
    assert out.num_cached_tokens == 2 * BLOCK
    assert "is bad" in caplog.text and "deleted" in caplog.text
    settle(reader)
    assert client.get(key) != bytes(record)  # deleted, then written again from the computed KV


def test_blocks_expire_and_a_hit_refreshes_their_ttl(tiny_dir, redis_server):
    path = tiny_dir(kind="llama")
    prompt = long_prompt(3)
    writer = engine(path, redis_server.url, ttl=3)
    writer.generate([prompt], PARAMS, use_tqdm=False)
    settle(writer)
    client = redis_server.client()
    keys = stored_keys(redis_server)
    assert keys and all(0 < client.ttl(k) <= 3 for k in keys)
    time.sleep(1.5)
    reader = engine(path, redis_server.url, ttl=3)
    reader.generate([prompt], PARAMS, use_tqdm=False)
    assert reader.engine.kv_store.stats()["kv_store_hits"] == 9
    refreshed = [client.pttl(k) for k in keys]
    assert sum(t > 2000 for t in refreshed) == 9, refreshed   # the 9 prompt blocks: TTL back to 3 s
    time.sleep(3.2)
    assert stored_keys(redis_server) == []                     # expired
    late = engine(path, redis_server.url, ttl=3)
    late.generate([prompt], PARAMS, use_tqdm=False)
    assert late.engine.kv_store.stats()["kv_store_hits"] == 0


def run_through(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate(prompts, PARAMS, use_tqdm=False)
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    return [o.outputs[0].token_ids for o in outs]


def keep_asking(llm: LLM, reference: LLM, seed: int, within: float = 120.0) -> None:
    """New prompts (so that the store is asked) until the breaker closes, each answered right
    (``within`` only guards against a hang)."""
    deadline = time.monotonic() + within
    while llm.engine.kv_store.breaker.is_open and time.monotonic() < deadline:
        prompt = [long_prompt(seed)]
        seed += 1
        assert run_through(llm, prompt) == run_through(reference, prompt)
        time.sleep(0.1)


def test_redis_killed_then_restarted_never_fails_a_request(tiny_dir, redis_server, caplog):
    path = tiny_dir(kind="llama")
    prompts = [long_prompt(10 + i) for i in range(3)]
    reference = LLM(str(path), dtype="float32")
    want = run_through(reference, prompts)
    llm = engine(path, redis_server.url, timeout_ms=100, breaker_errors=2, breaker_cooldown=0.5)
    with caplog.at_level(logging.INFO, logger="duoserve.kv"):
        assert run_through(llm, prompts[:1]) == want[:1]
        redis_server.stop()
        for _ in range(3):   # lookups and writes fail: the breaker opens, requests compute
            assert run_through(llm, prompts) == want
        assert llm.engine.kv_store.breaker.is_open
        assert "circuit breaker open" in caplog.text
        redis_server.start()   # same port, empty: picked up after a cooldown or two, no restart
        keep_asking(llm, reference, seed=100)
        settle(llm)
        assert not llm.engine.kv_store.breaker.is_open
        assert "circuit breaker closed" in caplog.text
    errors = llm.engine.kv_store.stats()["kv_store_errors"]
    assert errors.get("connection", 0) > 0
    assert len(stored_keys(redis_server)) > 0   # writing again
    assert_pool_whole(llm)


def test_redis_paused_beyond_the_timeout_never_fails_a_request(tiny_dir, redis_server, caplog):
    path = tiny_dir(kind="llama")
    prompts = [long_prompt(20 + i) for i in range(2)]
    reference = LLM(str(path), dtype="float32")
    want = run_through(reference, prompts)
    llm = engine(path, redis_server.url, timeout_ms=50, breaker_errors=2, breaker_cooldown=0.5)
    os.kill(redis_server.proc.pid, signal.SIGSTOP)
    try:
        with caplog.at_level(logging.INFO, logger="duoserve.kv"):
            start = time.monotonic()
            assert run_through(llm, prompts) == want
            # a request stuck behind the paused store would wait forever: this is a hang guard
            assert time.monotonic() - start < 120, "a request waited on the paused store"
            assert llm.engine.kv_store.stats()["kv_store_errors"].get("timeout", 0) > 0
            assert llm.engine.kv_store.breaker.is_open
    finally:
        os.kill(redis_server.proc.pid, signal.SIGCONT)
    with caplog.at_level(logging.INFO, logger="duoserve.kv"):
        keep_asking(llm, reference, seed=200)
    assert not llm.engine.kv_store.breaker.is_open and "circuit breaker closed" in caplog.text


def test_redis_refusing_writes_never_fails_a_request(tiny_dir):
    from tests.conftest import RedisServer

    full = RedisServer("--maxmemory-policy", "noeviction")
    try:
        client = full.client()  # below what it already uses: every write is refused, reads still answer
        client.config_set("maxmemory", client.info("memory")["used_memory"] // 2)
        path = tiny_dir(kind="llama")
        prompts = [long_prompt(30 + i) for i in range(2)]
        want = run_through(LLM(str(path), dtype="float32"), prompts)
        llm = engine(path, full.url, breaker_errors=100)
        assert run_through(llm, prompts) == want
        settle(llm)
        stats = llm.engine.kv_store.stats()
        assert stats["kv_store_errors"].get("refused", 0) > 0
        assert stats["kv_store_dropped_writes"] > 0 and stats["kv_store_bytes_written"] == 0
        assert stored_keys(full) == []
    finally:
        full.stop()


def test_a_bad_store_url_is_a_config_error():
    from duoserve.errors import ConfigError

    for url in ("http://localhost:6379", "redis://", "localhost:6379"):
        with pytest.raises(ConfigError, match="kv_store"):
            KVStoreConfig(url)
    with pytest.raises(ConfigError, match="kv_store_ttl"):
        KVStoreConfig("redis://localhost:6379/0", ttl=0)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_store_that_does_not_answer_at_start_is_named(tiny_dir, caplog):
    """Nothing listening: a warning naming the address (password left out) and an engine that
    serves without the store; with ``required`` no engine at all."""
    from duoserve.errors import KVStoreUnavailable

    path = tiny_dir(kind="llama")
    url = f"redis://:secret@127.0.0.1:{free_port()}/0"
    with caplog.at_level(logging.WARNING, logger="duoserve.kv.store"):
        llm = engine(path, url)
    warning = [r.getMessage() for r in caplog.records if "does not answer" in r.getMessage()]
    assert len(warning) == 1 and "secret" not in warning[0]
    assert warning[0].startswith(f"the KV store redis://127.0.0.1:{url.rsplit(':', 1)[1]} does not answer (ConnectionError")
    assert warning[0].endswith(": serving without it until it does")
    prompt = long_prompt(60)
    assert run_through(llm, [prompt]) == run_through(LLM(str(path), dtype="float32"), [prompt])
    with pytest.raises(KVStoreUnavailable, match=r"does not answer .*; --kv-store-required: not starting"):
        engine(path, url, required=True)


def test_two_servers_share_one_store(redis_server, tmp_path):
    """Two ``duoserve serve`` processes of the default model: the second serves a long prompt
    from the first one's blocks, counts the hits and reports them as cached tokens."""
    from tests.server_helpers import Server, metric

    prompt = "Summarize this report. " + " ".join(f"Section {i} describes part {i * 7} of the plan." for i in range(60))
    body = {"model": "smollm2-135m", "prompt": prompt, "max_tokens": 8, "temperature": 0}
    flags = ("--dtype", "float32", "--quantization", "none", "--kv-cache-memory", "0.4", "--num-threads", "2",
             "--kv-store", redis_server.url)
    replies, hits = [], None
    for name in ("a", "b"):
        server = Server(*flags, log=tmp_path / f"{name}.log")
        try:
            replies.append(httpx.post(f"{server.url}/v1/completions", json=body, timeout=120).json())
            expected = (replies[0]["usage"]["prompt_tokens"] - 1) // 16
            if name == "a":   # the writer thread works behind the reply: wait for the prompt's blocks in Redis
                assert until(lambda: len(stored_keys(redis_server)) >= expected, within=30)
            else:             # the counter reaches /metrics with the engine's next stats message
                until(lambda: metric(server.url, "duoserve:kv_store_hits_total") == expected, within=30)
                hits = metric(server.url, "duoserve:kv_store_hits_total")
        finally:
            server.stop()
    first, second = replies
    assert second["choices"][0]["text"] == first["choices"][0]["text"]
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == expected * 16
    assert hits == expected


def until(condition, within: float) -> bool:
    """Whether ``condition()`` holds within ``within`` seconds (asked every 50 ms)."""
    deadline = time.monotonic() + within
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_prefill_and_decode_engines_share_the_store(tiny_dir, redis_server):
    """A disaggregated pair writes the prompt's blocks (from the prefill engine) and the output's
    (from the decode engine); a second prefill engine finds the prompt's there."""
    from duoserve.config import DisaggConfig
    from tests.disagg_helpers import joined_in_process
    from tests.e2e.test_disagg_inprocess import pool_whole, run

    path = tiny_dir(kind="llama")
    base = EngineConfig(model=ModelConfig(model=str(path), dtype="float32"),
                        cache=CacheConfig(kv_cache_memory=0.01), kv_store=KVStoreConfig(redis_server.url))
    prompt = long_prompt(40)
    want = LLM(str(path), dtype="float32").generate([prompt], PARAMS, use_tqdm=False)[0].outputs[0].token_ids
    for round_ in range(2):
        prefill_config, decode_config = DisaggConfig().engine_configs(base)
        prefill, decode = joined_in_process(build_engine(prefill_config), build_engine(decode_config))
        got, _ = run(prefill, decode, [prompt], PARAMS)
        assert got == [want]
        assert pool_whole(prefill) and pool_whole(decode)
        hits = prefill.kv_store.stats()["kv_store_hits"]
        assert hits == (0 if round_ == 0 else 9)
        wait_for_store_writes(prefill, decode)
    assert len(stored_keys(redis_server)) == (150 + 12 - 1) // BLOCK
