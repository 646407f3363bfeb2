"""Which requests die with an engine: the router's placements, with fake engine clients."""

from __future__ import annotations

from types import SimpleNamespace

from duoserve import SamplingParams
from duoserve.core.request import Request
from duoserve.frontend.router import EngineGroup


class FakeClient:
    def __init__(self, name: str) -> None:
        self.name = name
        self.ready = SimpleNamespace(instance_id=f"{name}-1", max_model_len=64, vocab_size=10, eos_token_ids=[0])
        self.tokenizer = None
        self.added: list[str] = []

    def is_up(self) -> bool:
        return True

    def add_request(self, request, kv_peer=None, kv_peer_instance=None) -> None:
        self.added.append(request.request_id)


def test_a_prefill_engine_that_dies_takes_the_samples_it_has_not_handed_over():
    decode, prefill = FakeClient("decode-0"), FakeClient("prefill-0")
    group = EngineGroup([decode], [prefill])
    for rid, n in (("single", 1), ("pair", 2), ("quad", 4)):
        group.add_request(Request(rid, [1, 2, 3], SamplingParams(n=n, max_tokens=4), (0,), 16))
    assert prefill.added == ["single", "pair", "quad"]
    group.note_outputs(prefill, ["single", "pair", "pair/1", "quad"])   # first tokens
    group.note_outputs(decode, ["single", "pair", "quad", "quad/2", "quad/1"])   # handed over so far
    assert sorted(group.stranded_by(prefill)) == ["pair", "quad"], "a sample still on the prefill engine"
    group.note_outputs(decode, ["pair/1", "quad/3"])
    assert group.stranded_by(prefill) == []
    assert sorted(group.stranded_by(decode)) == ["pair", "quad", "single"]
