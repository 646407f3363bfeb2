"""KV events from a real server's engines (``--kv-events-endpoint``), read with vLLM's schema: a
served prompt's full blocks arrive as BlockStored whose hashes a router computes from the prompt
alone, chained parent to child; every engine publishes on its own port, named in the topic."""

from __future__ import annotations

import httpx
import pytest
import zmq

from tests.kv.test_kv_events import DECODER, VllmAllBlocksCleared, VllmBlockStored, router_hash
from tests.server_helpers import Server, free_port

BLOCK = 16


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port, replay = free_port(), free_port()
    srv = Server("--dtype", "float32", "--quantization", "none", "--kv-cache-memory", "0.1", "--num-threads", "2",
                 "--kv-events-endpoint", f"tcp://127.0.0.1:{port}",
                 "--kv-events-replay-endpoint", f"tcp://127.0.0.1:{replay}",
                 log=tmp_path_factory.mktemp("kv-events") / "server.log")
    srv.events, srv.replay = f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay}"
    yield srv
    srv.stop()


def stored_events(sub, until_tokens: int) -> list[VllmBlockStored]:
    """BlockStored events read until they cover ``until_tokens`` tokens (a guard against a hang)."""
    found, covered = [], 0
    while covered < until_tokens:
        assert sub.poll(30_000), f"no KV event in 30 s; got {found}"
        for event in DECODER.decode(sub.recv_multipart()[2]).events:
            if isinstance(event, VllmBlockStored):
                found.append(event)
                covered += len(event.token_ids)
    return found


def test_a_served_prompts_blocks_arrive_with_the_hashes_a_router_computes(server):
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(server.events)
    prompt = [(7 * i + 3) % 5000 + 100 for i in range(3 * BLOCK + 5)]   # three full blocks and five tokens
    # a subscriber joins late (ZeroMQ's slow joiner): one request first, until the stream is heard
    for attempt in range(50):
        httpx.post(f"{server.url}/v1/completions", json={"prompt": [1000 + attempt] * BLOCK, "max_tokens": 1},
                   timeout=60)
        if sub.poll(200):
            break
    while sub.poll(200):   # drain what the warm-up published
        sub.recv_multipart()
    reply = httpx.post(f"{server.url}/v1/completions", json={"prompt": prompt, "max_tokens": 1}, timeout=60)
    assert reply.status_code == 200
    events = stored_events(sub, 3 * BLOCK)
    hashes = [h for e in events for h in e.block_hashes]
    expected, parent = [], None
    for i in range(3):
        parent = router_hash(parent, prompt[i * BLOCK:(i + 1) * BLOCK])
        expected.append(parent)
    assert hashes == expected
    assert events[0].parent_block_hash is None
    assert all(e.parent_block_hash == hashes[hashes.index(e.block_hashes[0]) - 1] for e in events[1:])
    assert [t for e in events for t in e.token_ids] == prompt[:3 * BLOCK]
    assert {(e.block_size, e.lora_id, e.medium) for e in events} == {(BLOCK, None, "CPU")}
    # the engine's first batch, long before this subscriber: AllBlocksCleared, by replay
    replay = ctx.socket(zmq.DEALER)
    replay.connect(server.replay)
    replay.send_multipart([b"", (0).to_bytes(8, "big")])
    assert replay.poll(30_000)
    _, number, body = replay.recv_multipart()
    assert int.from_bytes(number, "big") == 0 and DECODER.decode(body).events == [VllmAllBlocksCleared()]
    sub.close(linger=0)
    replay.close(linger=0)


def test_routed_on_kv_events_a_prompt_goes_to_the_engine_that_holds_its_prefix(tmp_path):
    """Two engines, ``--routing kv-events``: a prompt placed on engine-1 (engine-0 busy) is
    cached there; the same prefix asked again on an idle server goes to engine-1, which a tie
    would not give it (engine-0 comes first), and finds its blocks cached."""
    import threading

    from tests.server_helpers import metric, wait_metric

    port = free_port()
    srv = Server("--num-engines", "2", "--routing", "kv-events", "--kv-events-endpoint", f"tcp://127.0.0.1:{port}",
                 "--dtype", "float32", "--quantization", "none", "--kv-cache-memory", "0.1",
                 log=tmp_path / "server.log")
    try:
        placed = "duoserve:request_placements_total"
        busy = threading.Thread(target=lambda: httpx.post(
            f"{srv.url}/v1/completions", timeout=120,
            json={"prompt": [900 + i for i in range(20)], "max_tokens": 48, "ignore_eos": True}))
        busy.start()
        wait_metric(srv.url, placed, lambda v: v >= 1, {"decode_engine": "engine-0"})
        received = "duoserve:kv_event_batches_received_total"
        heard = metric(srv.url, received, {"engine": "engine-1"})
        prefix = [(11 * i + 5) % 4000 + 200 for i in range(3 * BLOCK)]
        first = httpx.post(f"{srv.url}/v1/completions", json={"prompt": prefix + [1, 2, 3], "max_tokens": 1},
                           timeout=120)
        assert first.status_code == 200 and metric(srv.url, placed, {"decode_engine": "engine-1"}) == 1
        busy.join()
        wait_metric(srv.url, received, lambda v: v > heard, {"engine": "engine-1"})   # its stores heard
        again = httpx.post(f"{srv.url}/v1/completions", json={"prompt": prefix + [7, 8], "max_tokens": 1},
                           timeout=120)
        assert again.status_code == 200
        assert metric(srv.url, placed, {"decode_engine": "engine-1"}) == 2
        assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 3 * BLOCK
    finally:
        srv.stop()
