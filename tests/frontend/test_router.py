"""The router's choices (``duoserve.frontend.router``): which engines prefill and decode each
request, which requests die with an engine, and which engines hear of an abort or a release.
Fake engine clients: no process, no model."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from duoserve import SamplingParams
from duoserve.core.request import Request
from duoserve.frontend.engine_client import EngineDeadError
from duoserve.frontend.router import EngineGroup, Router


class FakeClient:
    def __init__(self, name: str, max_model_len: int = 64) -> None:
        self.name = name
        self.ready = SimpleNamespace(instance_id=f"{name}-1", max_model_len=max_model_len, vocab_size=10,
                                     eos_token_ids=[0])
        self.tokenizer = None
        self.up = True
        self.added: list[tuple[str, str | None, str | None]] = []   # (request id, kv peer, its instance)
        self.told: list[tuple[str, str]] = []                       # (abort|finish_stopped|release, request id)

    def is_up(self) -> bool:
        return self.up

    def add_request(self, request, kv_peer=None, kv_peer_instance=None) -> None:
        self.added.append((request.request_id, kv_peer, kv_peer_instance))

    def abort(self, request_id: str) -> None:
        self.told.append(("abort", request_id))

    def finish_stopped(self, request_id: str) -> None:
        self.told.append(("finish_stopped", request_id))

    def release(self, request_id: str) -> None:
        self.told.append(("release", request_id))


def request(request_id: str, num_tokens: int = 3, n: int = 1) -> Request:
    return Request(request_id, list(range(1, num_tokens + 1)), SamplingParams(n=n, max_tokens=4), (0,), 64)


def engines(num_decode: int, num_prefill: int = 0, router: Router | None = None):
    decode = [FakeClient(f"decode-{i}") for i in range(num_decode)]
    prefill = [FakeClient(f"prefill-{i}") for i in range(num_prefill)]
    return EngineGroup(decode, prefill, router), decode, prefill


def place(group: EngineGroup, *request_ids: str, num_tokens: int = 3) -> list[tuple[str | None, str]]:
    """Add the requests; (prefill engine, decode engine) of each."""
    for request_id in request_ids:
        group.add_request(request(request_id, num_tokens))
    return [(group.placements[r].prefill, group.placements[r].decode) for r in request_ids]


def test_colocated_requests_go_to_the_least_loaded_engine_the_first_between_equals():
    group, (d0, d1), _ = engines(2)
    assert place(group, "a", "b", "c") == [(None, "decode-0"), (None, "decode-1"), (None, "decode-0")]
    assert group.load == {"decode-0": 2, "decode-1": 1}
    assert d0.added == [("a", None, None), ("c", None, None)] and d1.added == [("b", None, None)]


def test_a_released_request_no_longer_counts_towards_its_engines_load():
    group, _, _ = engines(2)
    place(group, "a", "b")
    group.release("a")
    assert "a" not in group.placements and group.load == {"decode-0": 0, "decode-1": 1}
    assert place(group, "c") == [(None, "decode-0")]


def test_an_engine_that_is_down_is_passed_over_and_none_up_is_an_error():
    group, (d0, d1), _ = engines(2)
    place(group, "a")
    d1.up = False
    assert place(group, "b") == [(None, "decode-0")], "decode-1 is idle but down"
    d0.up = False
    with pytest.raises(EngineDeadError, match="no decode engine is up"):
        group.add_request(request("c"))
    assert sorted(group.placements) == ["a", "b"], "a refused request leaves no placement"


def test_every_prompt_goes_to_a_prefill_engine_which_hands_its_kv_to_the_chosen_decode_engine():
    group, (d0, d1), (p0,) = engines(2, 1)   # --prefill-device cpu (the default)
    assert place(group, "a", "b", num_tokens=600) == [("prefill-0", "decode-0"), ("prefill-0", "decode-1")]
    assert p0.added == [("a", "decode-0", "decode-0-1"), ("b", "decode-1", "decode-1-1")]
    assert d0.added == d1.added == [], "a decode engine gets the request with its KV, from the prefill engine"
    assert group.load == {"decode-0": 1, "decode-1": 1, "prefill-0": 2}


def test_a_prefill_engine_counts_only_the_requests_it_has_not_prefilled_yet():
    group, (d0,), (p0, p1) = engines(1, 2)
    assert place(group, "a", "b") == [("prefill-0", "decode-0"), ("prefill-1", "decode-0")]
    group.note_outputs(p0, ["a"])   # its first token: prefilled
    assert group.load == {"decode-0": 2, "prefill-0": 0, "prefill-1": 1}
    assert place(group, "c") == [("prefill-0", "decode-0")]
    group.note_outputs(d0, ["b"])   # the decode engine's first output does not prefill it on prefill-1
    assert group.load["prefill-1"] == 1


def test_auto_prefills_short_prompts_remotely_and_long_ones_on_the_decode_engine():
    group, (d0,), (p0,) = engines(1, 1, Router("auto", max_prefill_len=8))
    assert place(group, "short", num_tokens=8) == [("prefill-0", "decode-0")]
    assert place(group, "long", num_tokens=9) == [(None, "decode-0")]
    assert p0.added == [("short", "decode-0", "decode-0-1")] and d0.added == [("long", None, None)]


def test_with_no_prefill_engine_up_the_decode_engine_prefills_and_it_is_said_once(caplog):
    group, (d0,), (p0,) = engines(1, 1)
    p0.up = False
    with caplog.at_level(logging.WARNING, logger="duoserve.frontend.router"):
        assert place(group, "a", "b") == [(None, "decode-0"), (None, "decode-0")]
        p0.up = True
        assert place(group, "c") == [("prefill-0", "decode-0")]
        p0.up = False
        assert place(group, "d") == [(None, "decode-0")]
    warnings = [r.getMessage() for r in caplog.records]
    assert warnings == ["no prefill engine is up: prefilling on the decode engines"] * 2, \
        "once per outage, not once per request"


def test_placement_hooks_hear_each_choice():
    group, _, _ = engines(1, 1, Router("auto", max_prefill_len=4))
    heard = []
    group.on_place.append(lambda *args: heard.append(args))
    place(group, "a", num_tokens=3)
    place(group, "b", num_tokens=5)
    assert heard == [("a", "prefill-0", "decode-0"), ("b", None, "decode-0")]


def test_aborts_and_releases_reach_the_engines_of_the_placement_that_are_up():
    group, (d0, d1), (p0,) = engines(2, 1)
    place(group, "a", "b")   # a: prefill-0 -> decode-0; b: prefill-0 -> decode-1
    group.finish_stopped("a")
    group.abort("b")
    p0.up = False
    group.release("b")
    group.abort("unplaced")   # never placed here (or released already): every engine up hears it
    assert p0.told == [("finish_stopped", "a"), ("abort", "b")]
    assert d0.told == [("finish_stopped", "a"), ("abort", "unplaced")]
    assert d1.told == [("abort", "b"), ("release", "b"), ("abort", "unplaced")]
    assert sorted(group.placements) == ["a"]


def test_a_samples_stop_is_told_to_every_engine_up():
    """Placements are kept by request id, so a sample's id ("a/1") finds none: every engine
    hears it (an engine that never held the sample remembers the id in a bounded list)."""
    group, (d0, d1), (p0,) = engines(2, 1)
    place(group, "a")
    group.finish_stopped("a/1")
    assert p0.told == d0.told == d1.told == [("finish_stopped", "a/1")]


def test_the_context_is_what_every_engine_can_hold():
    decode, prefill = FakeClient("decode-0", max_model_len=64), FakeClient("prefill-0", max_model_len=48)
    group = EngineGroup([decode], [prefill])
    assert group.max_model_len == 48
    group.engine_up(FakeClient("decode-1", max_model_len=32))
    assert group.max_model_len == 32
    group.engine_up(FakeClient("decode-2", max_model_len=128))
    assert group.max_model_len == 32, "a larger engine does not raise it"


def test_a_prefill_engine_that_dies_takes_the_samples_it_has_not_handed_over():
    group, (decode,), (prefill,) = engines(1, 1)
    for rid, n in (("single", 1), ("pair", 2), ("quad", 4)):
        group.add_request(request(rid, n=n))
    assert [r for r, _, _ in prefill.added] == ["single", "pair", "quad"]
    group.note_outputs(prefill, ["single", "pair", "pair/1", "quad"])   # first tokens
    group.note_outputs(decode, ["single", "pair", "quad", "quad/2", "quad/1"])   # handed over so far
    assert sorted(group.stranded_by(prefill)) == ["pair", "quad"], "a sample still on the prefill engine"
    group.note_outputs(decode, ["pair/1", "quad/3"])
    assert group.stranded_by(prefill) == []
    assert sorted(group.stranded_by(decode)) == ["pair", "quad", "single"]
