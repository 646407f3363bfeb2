"""The KV tier on disk: a restarted engine (or another one on the same files) serves a known
prompt's prefix from it with the same tokens; a flipped byte, a file cut short or another model's
record is caught, recomputed and counted, never served; a torn write is removed at start; the
least recently used files go first past the size; and it works beside the Redis tier."""

from __future__ import annotations

import os
import random
import time

import pytest

from duoserve import LLM, SamplingParams
from duoserve.config import CacheConfig, EngineConfig, KVDiskConfig, KVStoreConfig, ModelConfig
from duoserve.engine.builder import build_engine
from duoserve.core.request import Request
from duoserve.errors import ConfigError
from duoserve.kv.disk_tier import SUFFIX, TORN_AFTER_S
from duoserve.kv.store_record import block_key
from tests.helpers import assert_pool_whole, wait_for_store_writes

PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
BLOCK = 16


def long_prompt(seed: int = 0, length: int = 150) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(length)]


def engine(path, directory, max_bytes: int = 1 << 30, redis_url: str | None = None, **model) -> LLM:
    config = EngineConfig(model=ModelConfig(model=str(path), dtype="float32", **model),
                          cache=CacheConfig(block_size=BLOCK, kv_cache_memory=0.01),
                          kv_disk=KVDiskConfig(str(directory), max_bytes),
                          kv_store=KVStoreConfig(redis_url) if redis_url else None)
    return LLM.from_engine(build_engine(config))


def files(directory) -> list:
    return sorted(directory.glob(f"*/*{SUFFIX}"))


def run(llm: LLM, prompt: list[int]):
    (out,) = llm.generate([prompt], PARAMS, use_tqdm=False)
    wait_for_store_writes(llm.engine)
    return out


@pytest.fixture
def written(tiny_dir, tmp_path):
    """A prompt computed once by an engine that wrote its blocks to disk and ended: (model, dir, prompt, tokens)."""
    path, prompt = tiny_dir(kind="llama"), long_prompt()
    first = engine(path, tmp_path)
    out = run(first, prompt)
    first.engine.close()
    assert len(files(tmp_path)) == (150 + 12 - 1) // BLOCK   # every full block, the outputs' too
    return path, tmp_path, prompt, out.outputs[0].token_ids


def test_a_restarted_engine_serves_the_prefix_from_disk(written):
    path, directory, prompt, want = written
    second = engine(path, directory)
    out = run(second, prompt)
    assert out.outputs[0].token_ids == want
    stats = second.engine.kv_disk.stats()
    assert stats["kv_disk_hits"] == 9 and stats["kv_disk_misses"] == 0 and stats["kv_disk_errors"] == {}
    assert out.num_cached_tokens == 9 * BLOCK
    assert second.engine.measures.num_prompt_tokens == 150 - 9 * BLOCK   # only the last, partial block computed
    assert stats["kv_disk_files"] == len(files(directory))
    assert_pool_whole(second)


def test_a_flipped_byte_is_caught_the_block_recomputed(written):
    path, directory, prompt, want = written
    second = engine(path, directory)
    probe = Request("probe", prompt, PARAMS)   # the prompt's block files, through the engine's own hashing
    second.engine.kv._extend_hashes(probe, 9 * BLOCK)
    disk = second.engine.kv_disk
    keys = [disk.tier._path(block_key(disk.root, block_hash)) for block_hash in probe.block_hashes]
    assert len(keys) == 9 and all(k.exists() for k in keys)
    record = bytearray(keys[3].read_bytes())
    record[-100] ^= 0x01   # one bit of the fourth block's KV
    keys[3].write_bytes(bytes(record))
    out = run(second, prompt)
    assert out.outputs[0].token_ids == want
    stats = second.engine.kv_disk.stats()
    assert stats["kv_disk_hits"] == 3 and stats["kv_disk_errors"] == {"corrupt": 1}
    assert out.num_cached_tokens == 3 * BLOCK
    assert keys[3].exists()   # deleted, then written again whole by this engine
    assert_pool_whole(second)


def test_torn_and_cut_files_are_skipped(written):
    path, directory, prompt, want = written
    kept = files(directory)
    torn = kept[0].with_name(kept[0].name + ".1234.part")   # a process killed mid-write left this, long ago
    torn.write_bytes(b"half a record")
    os.utime(torn, (time.time() - 2 * TORN_AFTER_S,) * 2)
    fresh = kept[1].with_name(kept[1].name + ".5678.part")   # another engine's write in progress: kept
    fresh.write_bytes(b"being written")
    for victim in kept:   # every record cut short (the machine went down while the page cache was dirty)
        victim.write_bytes(victim.read_bytes()[:-7])
    second = engine(path, directory)
    assert not torn.exists() and fresh.exists() and second.engine.kv_disk.stats()["kv_disk_torn"] == 1
    out = run(second, prompt)
    assert out.outputs[0].token_ids == want and out.num_cached_tokens == 0
    assert second.engine.kv_disk.stats()["kv_disk_errors"] == {"corrupt": 1}   # the first block: the run stops
    assert_pool_whole(second)


def test_another_model_never_reads_them(written, tiny_dir):
    _, directory, prompt, _ = written
    other = engine(tiny_dir(kind="qwen2"), directory)
    out = run(other, prompt)
    assert out.num_cached_tokens == 0 and other.engine.kv_disk.stats()["kv_disk_hits"] == 0


def test_the_least_recently_used_go_first_past_the_size(tiny_dir, tmp_path):
    path = tiny_dir(kind="llama")
    probe = engine(path, tmp_path / "probe")
    run(probe, long_prompt())
    block_bytes = files(tmp_path / "probe")[0].stat().st_size
    llm = engine(path, tmp_path / "small", max_bytes=4 * block_bytes)
    run(llm, long_prompt(1))
    stats = llm.engine.kv_disk.stats()
    assert len(files(tmp_path / "small")) == stats["kv_disk_files"] == 4
    assert stats["kv_disk_evicted"] == (150 + 12 - 1) // BLOCK - 4 and stats["kv_disk_bytes_stored"] <= 4 * block_bytes
    again = engine(path, tmp_path / "small", max_bytes=4 * block_bytes)
    assert run(again, long_prompt(1)).num_cached_tokens == 0   # the first blocks went first: no prefix left


def test_disk_first_then_redis(written, redis_server, tiny_dir):
    """Disk and Redis together: what the disk lacks comes from Redis, and both get what is computed."""
    path, directory, prompt, want = written
    longer = prompt + long_prompt(2, 64)
    feeder = engine(path, directory / "elsewhere", redis_url=redis_server.url)
    run(feeder, longer)          # Redis holds all of the longer prompt's blocks
    both = engine(path, directory, redis_url=redis_server.url)
    out = run(both, longer)
    disk, redis = both.engine.kv_disk.stats(), both.engine.kv_store.stats()
    # the disk's 10th block holds the first run's outputs, not these tokens: 9 from disk, the rest from Redis
    assert disk["kv_disk_hits"] == 9 and redis["kv_store_hits"] == (len(longer) - 1) // BLOCK - 9
    assert out.num_cached_tokens == (len(longer) - 1) // BLOCK * BLOCK
    assert_pool_whole(both)


def test_bad_settings_are_refused_by_name(tmp_path):
    with pytest.raises(ConfigError, match="kv_disk_bytes"):
        KVDiskConfig(str(tmp_path), 0)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="kv_disk_path"):
        KVDiskConfig(str(tmp_path / "file"))


def test_kill_9_while_writing_then_the_next_start_serves_what_was_written(tmp_path):
    """A server killed (SIGKILL, its whole process group) while its engine computes a second prompt
    and writes its blocks: the next start removes what was half written and serves the rest, with
    the same text. Where in a write the kill lands varies, so one torn file is planted as well."""
    import signal

    import httpx

    from tests.conftest import API_KEY
    from tests.server_helpers import Server, alive, descendants, metric

    directory = tmp_path / "kv"
    args = ("--dtype", "float32", "--quantization", "none", "--kv-cache-memory", "0.5", "--kv-disk-path",
            str(directory))
    headers = {"Authorization": f"Bearer {API_KEY}"}
    prompt = " ".join(["The tide rises and falls twice a day, pulled by the moon and, less, by the sun."] * 30)
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0}
    srv = Server(*args, api_key=API_KEY, new_session=True, log=tmp_path / "first.log")
    try:
        first = httpx.post(f"{srv.url}/v1/completions", json=body, headers=headers, timeout=300).json()
        deadline = time.monotonic() + 60
        while len(files(directory)) < 20 and time.monotonic() < deadline:   # its blocks on their way out
            time.sleep(0.01)
        other = {**body, "prompt": prompt.replace("tide", "sea")}   # more blocks to write, then the kill
        with pytest.raises(httpx.HTTPError):
            httpx.post(f"{srv.url}/v1/completions", json=other, headers=headers, timeout=0.5)
        family = [srv.proc.pid, *descendants(srv.proc.pid)]
        os.killpg(srv.proc.pid, signal.SIGKILL)
        srv.proc.wait(timeout=30)
    finally:
        srv.stop()
    deadline = time.monotonic() + 30
    while any(alive(pid) for pid in family) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(alive(pid) for pid in family)
    written = len(files(directory))
    assert written >= 20
    planted = files(directory)[0].parent / ("f" * 62 + ".kvb.999.part")   # one torn for sure, long ago
    planted.write_bytes(b"torn")
    os.utime(planted, (time.time() - 2 * TORN_AFTER_S,) * 2)
    again = Server(*args, api_key=API_KEY, log=tmp_path / "second.log")
    try:
        reply = httpx.post(f"{again.url}/v1/completions", json=body, headers=headers, timeout=300).json()
        assert reply["choices"][0]["text"] == first["choices"][0]["text"]
        assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] >= 20 * BLOCK
        assert metric(again.url, "duoserve:kv_disk_hits_total", headers=headers) >= 20
        assert metric(again.url, "duoserve:kv_disk_torn_total", headers=headers) >= 1
        assert not planted.exists()   # (a .part the kill left just now stays until it is old: never read)
        assert metric(again.url, "duoserve:kv_disk_errors_total", headers=headers) == 0
    finally:
        again.stop()
