"""KV events (``duoserve.kv.events``): what the prefix cache stores and evicts, in vLLM's format,
read back by a msgspec decoder written here from vLLM's published schema (its example
subscriber's structures), over a real ZeroMQ PUB socket and its replay socket."""

from __future__ import annotations

import hashlib
import struct

import msgspec
import pytest
import zmq

from duoserve.core.kv_cache_manager import KVCacheManager
from duoserve.core.request import Request
from duoserve.kv.events import BlockRemoved, BlockStored, KVEventPublisher
from duoserve.sampling_params import SamplingParams


# ---- vLLM's schema (vllm.distributed.kv_events, as its kv_events_subscriber example copies it) ----

class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class VllmBlockStored(KVCacheEvent, tag="BlockStored"):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class VllmBlockRemoved(KVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[bytes | int]
    medium: str | None


class VllmAllBlocksCleared(KVCacheEvent, tag="AllBlocksCleared"):
    pass


class VllmKVEventBatch(EventBatch):
    events: list[VllmBlockStored | VllmBlockRemoved | VllmAllBlocksCleared]


DECODER = msgspec.msgpack.Decoder(type=VllmKVEventBatch)


def router_hash(parent: bytes | None, tokens: list[int]) -> bytes:
    """How a router hashes a prompt's blocks to find them: duoserve's rule, written out."""
    return hashlib.sha256((parent or bytes(32)) + struct.pack(f"<{len(tokens)}i", *tokens)).digest()


def test_stored_blocks_chain_parent_to_child_and_evictions_are_removed():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    kv.record_events()
    first = Request("a", list(range(10, 20)), SamplingParams())          # two full blocks and two tokens
    kv.allocate_slots(first, 10)
    [(kind, hashes, parent, tokens)] = kv.drain_events()
    assert (kind, parent, tokens) == ("stored", None, list(range(10, 18)))
    assert hashes == [router_hash(None, list(range(10, 14))), router_hash(hashes[0], list(range(14, 18)))]
    kv.free(first)
    second = Request("b", list(range(50, 66)), SamplingParams())          # four blocks: every cached one evicted
    kv.allocate_slots(second, 16)
    events = kv.drain_events()
    assert [e[0] for e in events] == ["removed", "stored"]
    assert sorted(events[0][1]) == sorted(hashes) and events[1][2] is None and len(events[1][1]) == 4
    assert kv.drain_events() == []


def test_a_prefix_hit_stores_only_the_new_blocks_with_their_parent():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    kv.record_events()
    kv.allocate_slots(Request("a", list(range(8)), SamplingParams()), 8)
    [(_, first_hashes, _, _)] = kv.drain_events()
    again = Request("b", list(range(8)) + [100, 101, 102, 103, 104], SamplingParams())
    hit = kv.find_cached_prefix(again)
    kv.allocate_slots(again, 5, hit)
    [(kind, hashes, parent, tokens)] = kv.drain_events()
    assert (kind, parent, tokens) == ("stored", first_hashes[1], [100, 101, 102, 103])
    assert hashes == [router_hash(first_hashes[1], [100, 101, 102, 103])]


@pytest.fixture
def publisher(tmp_path):
    ctx = zmq.Context.instance()
    pub = KVEventPublisher(ctx, f"ipc://{tmp_path}/events", f"ipc://{tmp_path}/replay", "engine-0")
    yield pub, ctx, tmp_path
    pub.close()


def test_vllms_decoder_reads_the_stream_and_a_replay_returns_what_was_missed(publisher):
    pub, ctx, path = publisher
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv-events")   # what vLLM's subscriber example subscribes to
    sub.connect(f"ipc://{path}/events")
    hashes = [router_hash(None, [1, 2, 3, 4])]
    stored = BlockStored(hashes, None, [1, 2, 3, 4], 4, None, "CPU")
    for _ in range(200):   # a subscriber joins late (ZeroMQ's slow joiner): publish until it hears
        pub.publish([stored])
        if sub.poll(20):
            break
    topic, number, payload = sub.recv_multipart()
    assert topic == b"kv-events.engine-0"
    batch = DECODER.decode(payload)
    [event] = batch.events
    assert isinstance(event, VllmBlockStored) and event.block_hashes == hashes and event.parent_block_hash is None
    assert (event.token_ids, event.block_size, event.lora_id, event.medium) == ([1, 2, 3, 4], 4, None, "CPU")
    pub.publish([BlockRemoved(hashes, "CPU")])
    assert DECODER.decode(sub.recv_multipart()[2]).events == [VllmBlockRemoved(hashes, "CPU")]
    # a replay from batch 0: the engine's AllBlocksCleared (sent before anyone listened), what
    # was sent, then the end marker (a DEALER reads every reply: vLLM's answers come one a batch)
    replay = ctx.socket(zmq.DEALER)
    replay.connect(f"ipc://{path}/replay")
    replay.send_multipart([b"", (0).to_bytes(8, "big")])
    for _ in range(200):
        pub.serve_replay()
        if replay.poll(20):
            break
    replies = []
    while True:
        _, number_bytes, body = replay.recv_multipart()
        if not body:
            assert int.from_bytes(number_bytes, "big", signed=True) == -1
            break
        replies.append((int.from_bytes(number_bytes, "big"), DECODER.decode(body).events))
    assert replies[0] == (0, [VllmAllBlocksCleared()])
    assert [n for n, _ in replies] == list(range(int.from_bytes(number, "big") + 2))
    assert replies[-1][1] == [VllmBlockRemoved(hashes, "CPU")]
    sub.close(linger=0)
    replay.close(linger=0)


def test_each_engine_binds_the_ports_plus_its_index_and_a_wrong_endpoint_is_named():
    from duoserve.config import KVEventsConfig
    from duoserve.engine_args import EngineArgs
    from duoserve.errors import ConfigError

    events = KVEventsConfig("tcp://*:5557", "tcp://*:5657")
    assert events.for_engine(2) == KVEventsConfig("tcp://*:5559", "tcp://*:5659")
    assert KVEventsConfig("ipc:///tmp/ev").for_engine(3) == KVEventsConfig("ipc:///tmp/ev-3")
    assert events.for_engine(0) == events
    with pytest.raises(ConfigError) as err:
        KVEventsConfig("localhost:5557")
    assert err.value.field == "kv_events_endpoint"
    with pytest.raises(ConfigError) as err:
        EngineArgs(kv_events_replay_endpoint="tcp://*:5558").create_engine_config()
    assert err.value.field == "kv_events_replay_endpoint"
    assert EngineArgs(kv_events_endpoint="tcp://*:5557").create_engine_config().kv_events == \
        KVEventsConfig("tcp://*:5557")


def test_routing_on_kv_events_needs_engines_that_publish_them():
    from duoserve.cli.args import build_parser
    from duoserve.cli.configs import cluster_config_from_args
    from duoserve.errors import ConfigError

    parse = build_parser().parse_args
    with pytest.raises(ConfigError) as err:
        cluster_config_from_args(parse(["serve", "--routing", "kv-events"]))
    assert err.value.field == "routing"
    assert cluster_config_from_args(parse(["serve", "--routing", "kv-events", "--kv-events-endpoint",
                                           "tcp://*:5557"])).routing == "kv-events"
