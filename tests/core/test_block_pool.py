"""BlockPool and KVCacheManager: exact block ids, reference counts, LRU eviction order."""

from __future__ import annotations

import pytest

from duoserve.core.block_pool import BlockPool, hash_block
from duoserve.core.kv_cache_manager import KVCacheManager
from duoserve.core.request import Request
from duoserve.sampling_params import SamplingParams


def make_request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4))


def test_hash_is_stable_and_chained():
    a = hash_block(None, [1, 2, 3])
    assert a == hash_block(None, [1, 2, 3])
    assert hash_block(a, [4]) != hash_block(None, [4])
    assert hash_block(None, [1, 2, 3], b"salt") != a


def test_hash_known_value():
    # sha256(32 zero bytes + int32 LE 1,2,3): pinned so the digest never silently changes
    import hashlib
    import struct

    expected = hashlib.sha256(b"\x00" * 32 + struct.pack("<3i", 1, 2, 3)).digest()
    assert hash_block(None, [1, 2, 3]) == expected


def test_allocate_takes_from_head_and_release_appends_to_tail():
    pool = BlockPool(6)
    first = pool.allocate(2)
    assert [b.block_id for b in first] == [0, 1]
    assert [b.ref_count for b in first] == [1, 1]
    assert pool.free_queue.block_ids() == [2, 3, 4, 5]
    pool.release(reversed(first))
    assert pool.free_queue.block_ids() == [2, 3, 4, 5, 1, 0]
    assert pool.num_free_blocks == 6
    with pytest.raises(ValueError, match="asked for 7 blocks with only 6 free"):
        pool.allocate(7)


def test_touch_removes_free_cached_block_and_counts_refs():
    pool = BlockPool(4)
    (block,) = pool.allocate(1)
    pool.cache(block, b"h" * 32)
    pool.touch([block])
    assert block.ref_count == 2
    pool.release([block])
    assert block.ref_count == 1 and pool.num_free_blocks == 3
    pool.release([block])
    assert pool.free_queue.block_ids() == [1, 2, 3, 0]
    assert pool.lookup(b"h" * 32) is block  # still cached while free
    pool.touch([block])
    assert pool.free_queue.block_ids() == [1, 2, 3] and block.ref_count == 1
    pool.release([block])
    assert pool.num_free_blocks == 4


def test_eviction_only_when_free_blocks_run_out_in_lru_order():
    pool = BlockPool(3)
    blocks = pool.allocate(3)
    for i, b in enumerate(blocks):
        pool.cache(b, bytes([i]) * 32)
    pool.release([blocks[2], blocks[0], blocks[1]])  # free order: 2, 0, 1
    assert pool.free_queue.block_ids() == [2, 0, 1]
    (taken,) = pool.allocate(1)
    assert taken.block_id == 2 and taken.block_hash is None
    assert pool.lookup(bytes([2]) * 32) is None and pool.lookup(bytes([0]) * 32) is blocks[0]
    assert pool.num_evictions == 1
    pool.release([taken])
    assert pool.num_free_blocks == 3


def test_manager_prefix_hit_shares_blocks_and_frees_tail_first():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = make_request("a", list(range(10)))  # 2 full blocks + 2 tokens
    assert [b.block_id for b in kv.allocate_slots(a, 10)] == [0, 1, 2]
    a.num_computed_tokens = 10
    b = make_request("b", list(range(8)) + [99, 98, 97])
    hits = kv.find_cached_prefix(b)
    assert [blk.block_id for blk in hits] == [0, 1]
    assert [blk.block_id for blk in kv.allocate_slots(b, 3, hits)] == [3]
    assert kv.block_ids("b") == [0, 1, 3]
    assert [kv.pool.blocks[i].ref_count for i in range(4)] == [2, 2, 1, 1]
    kv.free(a)
    assert kv.pool.free_queue.block_ids() == [4, 5, 6, 7, 2]
    kv.free(b)
    assert kv.pool.free_queue.block_ids() == [4, 5, 6, 7, 2, 3, 1, 0]
    assert kv.pool.num_free_blocks == 8


def test_manager_never_hits_the_last_token():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a = make_request("a", list(range(8)))
    kv.allocate_slots(a, 8)
    kv.free(a)
    b = make_request("b", list(range(8)))
    hits = kv.find_cached_prefix(b)
    assert [blk.block_id for blk in hits] == [0]  # block 1 holds the last token: recomputed
    assert kv.allocate_slots(b, 4, hits) is not None
    assert kv.block_ids("b") == [0, 2]  # block 1 is evictable but not evicted: 2 was further up the queue
    kv.free(b)
    assert kv.pool.num_free_blocks == 4


def test_allocate_returns_none_without_side_effects():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    a = make_request("a", list(range(12)))
    assert kv.allocate_slots(a, 12) is None
    assert kv.pool.num_free_blocks == 2 and "a" not in kv.req_blocks


def test_reused_free_cached_block_is_not_counted_twice():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    a = make_request("a", list(range(5)))
    kv.allocate_slots(a, 5)
    kv.free(a)  # block 0 cached and free; block 1 free
    b = make_request("b", list(range(4)) + [7, 7, 7, 7, 7])
    hits = kv.find_cached_prefix(b)
    assert [blk.block_id for blk in hits] == [0]
    # needs 3 blocks in all: the hit + 2 new, but only 1 other block exists
    assert kv.allocate_slots(b, 5, hits) is None
    assert kv.pool.num_free_blocks == 2 and kv.pool.blocks[0].ref_count == 0


def test_disabled_caching_finds_nothing():
    kv = KVCacheManager(num_blocks=4, block_size=4, enable_caching=False)
    a = make_request("a", list(range(9)))
    kv.allocate_slots(a, 9)
    kv.free(a)
    assert kv.find_cached_prefix(make_request("b", list(range(9)))) == []
    assert kv.pool.cached == {}


def test_fork_shares_full_blocks_and_copies_tail():
    kv = KVCacheManager(num_blocks=6, block_size=4)
    parent = make_request("p", list(range(6)))
    kv.allocate_slots(parent, 6)
    child = make_request("p/1", list(range(6)))
    assert kv.fork(parent, child) == [(1, 2)]
    assert kv.block_ids("p/1") == [0, 2]
    assert kv.pool.blocks[0].ref_count == 2
    kv.free(parent)
    kv.free(child)
    assert kv.pool.num_free_blocks == 6
