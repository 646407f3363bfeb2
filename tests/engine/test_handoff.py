"""The KV handoff components on their own: ``SendKV`` (a prefill engine's) and ``ReceiveKV`` (a
decode engine's), joined by the in-process connector, stepped by hand. What leaves the prefill
engine is exactly its cache's rows; what the decode engine takes is acknowledged once; a
transfer for a request ended before it arrived is acknowledged and dropped; a failed send fails
only its own request."""

from __future__ import annotations

import pytest
import torch

from duoserve import SamplingParams
from duoserve.config import CacheConfig, EngineConfig, ModelConfig
from duoserve.core.request import Request
from duoserve.engine.builder import build_engine
from duoserve.engine.handoff import ReceiveKV, SendKV
from duoserve.kv.connector import InProcessConnector
from tests.disagg_helpers import joined_in_process
from tests.helpers import assert_pool_whole

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPT = list(range(3, 40))   # 37 tokens: two full blocks of 16 and a partial one


def engine(path, role: str, block_size: int = 16):
    return build_engine(EngineConfig(model=ModelConfig(model=str(path), dtype="float32"),
                                     cache=CacheConfig(block_size=block_size, kv_cache_memory=0.01), role=role))


@pytest.fixture(scope="module")
def pair(tiny_dir):
    return joined_in_process(engine(tiny_dir(kind="llama"), "prefill"), engine(tiny_dir(kind="llama"), "decode"))


class CatchingConnector(InProcessConnector):
    """The in-process connector, keeping every transfer sent."""

    def __init__(self) -> None:
        super().__init__()
        self.sent = []

    def send(self, transfer) -> None:
        self.sent.append(transfer)
        super().send(transfer)


def test_send_kv_ships_exactly_the_prompt_rows_of_the_cache_and_holds_them_until_acked(tiny_dir):
    prefill = engine(tiny_dir(kind="llama"), "prefill")
    assert type(prefill.handoff) is SendKV
    link = CatchingConnector()
    prefill.attach_connector(link)
    prefill.add_request(Request("r0", PROMPT, GREEDY, (), 512), kv_peer="decode-3", kv_peer_instance="i-1")
    (out,) = prefill.step()   # the whole prompt in one step: its first token, and the lease
    (transfer,) = link.sent
    assert out.new_token_ids == [transfer.meta.first_token] and transfer.peer == "decode-3"
    assert transfer.meta.instance_id == "i-1" and transfer.meta.prompt_token_ids == PROMPT
    arch = prefill.arch
    assert len(transfer.keys) == len(transfer.values) == arch.num_layers
    assert transfer.keys[0].shape == (len(PROMPT), arch.num_kv_heads, arch.head_dim)
    blocks = prefill.kv.block_ids("r0")   # leased: still the request's
    assert len(blocks) == 3
    slots = [b * 16 + i for b in blocks for i in range(16)][:len(PROMPT)]
    for layer, (k_cache, v_cache) in enumerate(prefill.runner.kv_caches):   # the cache's own rows, bit for bit
        assert torch.equal(transfer.keys[layer], k_cache.view(-1, arch.num_kv_heads, arch.head_dim)[slots])
        assert torch.equal(transfer.values[layer], v_cache.view(-1, arch.num_kv_heads, arch.head_dim)[slots])
    assert prefill.handoff.num_transfer_bytes == transfer.num_bytes
    held = prefill.kv.pool.num_free_blocks
    assert held < prefill.kv.pool.num_blocks, "the lease holds the prompt's blocks until the decode engine acks"
    assert prefill.has_unfinished() and not prefill.has_work()
    link.acknowledge("r0")
    assert prefill.step() == []
    prefill.release("r0")
    assert_pool_whole(prefill)


def test_receive_kv_takes_the_transfer_acks_it_once_and_restates_the_first_token_and_stages(pair):
    prefill, decode = pair
    assert type(decode.handoff) is ReceiveKV
    prefill.add_request(Request("r1", PROMPT, GREEDY, (), 512))
    (first,) = prefill.step()
    outs = decode.step()   # the transfer arrives, waits for blocks, and its KV goes in: one decode
    (out,) = outs
    assert out.position == 0 and out.new_token_ids[0] == first.new_token_ids[0] and len(out.new_token_ids) == 2
    # the prefill engine's stages too: its own output may reach the frontend after the request ends
    assert out.stages is not None and set(out.stages) == {"queue", "prefill", "transfer", "admit"}
    assert {s: out.stages[s] for s in ("queue", "prefill")} == first.stages
    assert prefill.connector.poll_acks() == ["r1"]
    tokens = out.new_token_ids
    while decode.has_unfinished():
        for o in decode.step():
            tokens += o.new_token_ids
            if o.finished:
                decode.release("r1")
    assert len(tokens) == GREEDY.max_tokens
    prefill.scheduler.acknowledge("r1")
    prefill.release("r1")
    assert_pool_whole(prefill)
    assert_pool_whole(decode)


def test_a_transfer_for_a_request_aborted_before_it_came_is_acked_and_dropped(pair):
    prefill, decode = pair
    prefill.add_request(Request("r2", PROMPT, GREEDY, (), 512))
    prefill.step()
    decode.abort("r2")        # the frontend's abort overtakes the transfer
    assert decode.step() == [] and not decode.has_unfinished(), "nothing computed for it"
    assert prefill.connector.poll_acks() == ["r2"], "the sender's lease is freed"
    prefill.scheduler.acknowledge("r2")
    prefill.release("r2")
    assert_pool_whole(prefill)
    assert_pool_whole(decode)


def test_a_failed_send_fails_only_its_request(tiny_dir):
    class Refusing(InProcessConnector):
        def send(self, transfer) -> None:
            if transfer.request_id == "bad":
                raise ConnectionError("no such decode engine: decode-9")
            super().send(transfer)

    prefill = engine(tiny_dir(kind="llama"), "prefill")
    prefill.attach_connector(Refusing())
    prefill.add_request(Request("bad", PROMPT, GREEDY, (), 512), kv_peer="decode-9")
    prefill.add_request(Request("good", PROMPT[:20], GREEDY, (), 512), kv_peer="decode-0")
    outs = {o.request_id: o for o in prefill.step()}
    assert outs["bad"].finish_reason == "error"
    assert outs["bad"].error == "the KV handoff failed: no such decode engine: decode-9"
    assert outs["good"].finish_reason is None and len(prefill.connector.poll_transfers()) == 1
    prefill.connector.acknowledge("good")
    prefill.step()
    for request_id in ("bad", "good"):
        prefill.release(request_id)
    assert_pool_whole(prefill)
