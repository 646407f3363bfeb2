"""The router's choices (``duoserve.frontend.router``): which engines prefill and decode each
request, which requests die with an engine, and which engines hear of an abort or a release.
Fake engine clients: no process, no model."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from duoserve import SamplingParams
from duoserve.core.block_pool import hash_block
from duoserve.core.outputs import EngineCoreOutput
from duoserve.core.request import Request
from duoserve.frontend.engine_client import EngineDeadError
from duoserve.frontend.placement import Rates
from duoserve.frontend.router import EngineGroup, Router


class FakeClient:
    def __init__(self, name: str, max_model_len: int = 64, num_blocks: int = 8) -> None:
        self.name = name
        self.ready = SimpleNamespace(instance_id=f"{name}-1", max_model_len=max_model_len, vocab_size=10,
                                     eos_token_ids=[0], block_size=4, num_blocks=num_blocks)
        self.tokenizer = None
        self.up = True
        self.rates = Rates()    # what its stats measured: nothing yet
        self.added: list[tuple[str, str | None, str | None]] = []   # (request id, kv peer, its instance)
        self.requests: list[Request] = []
        self.told: list[tuple[str, str]] = []                       # (abort|finish_stopped|release, request id)

    def is_up(self) -> bool:
        return self.up

    def add_request(self, request, kv_peer=None, kv_peer_instance=None) -> None:
        self.added.append((request.request_id, kv_peer, kv_peer_instance))
        self.requests.append(request)

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


def outs(*engine_ids: str) -> list[EngineCoreOutput]:
    """An output of one new token under each engine id."""
    return [EngineCoreOutput(engine_id, [7]) for engine_id in engine_ids]


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
    group.note_outputs(p0, outs("a"))   # its first token: prefilled
    assert group.load == {"decode-0": 2, "prefill-0": 0, "prefill-1": 1}
    assert place(group, "c") == [("prefill-0", "decode-0")]
    group.note_outputs(d0, outs("b"))   # the decode engine's first output does not prefill it on prefill-1
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


def test_a_samples_stop_is_told_to_the_engines_of_its_request():
    group, (d0, d1), (p0,) = engines(2, 1)
    place(group, "a")
    group.finish_stopped("a/1")
    assert p0.told == d0.told == [("finish_stopped", "a/1")] and d1.told == []


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
    group.note_outputs(prefill, outs("single", "pair", "pair/1", "quad"))   # first tokens
    group.note_outputs(decode, outs("single", "pair", "quad", "quad/2", "quad/1"))   # handed over so far
    assert sorted(group.stranded_by(prefill)) == ["pair", "quad"], "a sample still on the prefill engine"
    group.note_outputs(decode, outs("pair/1", "quad/3"))
    assert group.stranded_by(prefill) == []
    assert sorted(group.stranded_by(decode)) == ["pair", "quad", "single"]


def test_a_request_with_tokens_goes_on_on_a_survivor_under_a_new_id():
    group, (d0, d1), _ = engines(2)
    place(group, "a", "b")          # a on decode-0, b on decode-1
    d0.up = False
    assert group.migrate("a", {0: [5, 6]}, lost_on="decode-0") == "decode-1"
    (resumed,) = d1.requests[1:]
    assert (resumed.request_id, resumed.prompt_token_ids, resumed.output_token_ids) == ("a#1", [1, 2, 3], [5, 6])
    assert group.load == {"decode-0": 0, "decode-1": 2}
    assert group.placements["a"].lost_on == ["decode-0"]
    late = group.note_outputs(d0, outs("a"))          # the old placement's last words: dropped
    fresh = group.note_outputs(d1, outs("a#1", "b"))  # the new one's: under the frontend's id
    assert late == [] and [o.request_id for o in fresh] == ["a", "b"]
    group.abort("a")
    group.release("a")
    assert d1.told == [("abort", "a#1"), ("release", "a#1")] and group.aliases == {}


def test_the_samples_of_a_request_resume_one_by_one_and_hear_their_own_stops():
    group, (d0, d1), _ = engines(2)
    group.add_request(request("a", n=3))
    d0.up = False
    group.migrate("a", {0: [5], 2: [8, 9]}, lost_on="decode-0")   # sample 1 had finished
    assert [(r.request_id, r.sample_index, r.output_token_ids) for r in d1.requests] == \
        [("a#1", 0, [5]), ("a#1/2", 2, [8, 9])]
    assert [o.request_id for o in group.note_outputs(d1, outs("a#1/2", "a#1"))] == ["a/2", "a"]
    group.finish_stopped("a/2")
    group.release("a")
    assert d1.told == [("finish_stopped", "a#1/2"), ("release", "a#1"), ("release", "a#1/2")]


def test_a_request_without_a_token_starts_over_and_the_survivor_forgets_its_part():
    """Its prefill engine went down before the first token: placed like a new request (on the
    prefill engine up), and its decode engine, which may hold a transfer of it, forgets it."""
    group, (d0,), (p0, p1) = engines(1, 2)
    place(group, "a")                 # prefill-0 -> decode-0
    p0.up = False
    assert group.migrate("a", {}, lost_on="prefill-0") == "decode-0"
    assert p1.added == [("a#1", "decode-0", "decode-0-1")]
    assert d0.told == [("abort", "a"), ("release", "a")]
    assert (group.placements["a"].prefill, group.placements["a"].engine_id) == ("prefill-1", "a#1")
    p1.up = False                     # and again: a third id, on the decode engine itself
    group.migrate("a", {}, lost_on="prefill-1")
    assert d0.added == [("a#2", None, None)] and group.placements["a"].lost_on == ["prefill-0", "prefill-1"]


def test_with_no_decode_engine_up_a_migration_changes_nothing():
    group, (d0,), _ = engines(1)
    place(group, "a")
    d0.up = False
    with pytest.raises(EngineDeadError, match="no decode engine is up"):
        group.migrate("a", {0: [5]}, lost_on="decode-0")
    assert group.placements["a"].engine_id == "a" and group.aliases == {}


def test_the_resume_hook_hears_the_first_token_after_a_migration_once():
    group, (d0, d1), _ = engines(2)
    heard = []
    group.on_resume.append(heard.append)
    place(group, "a")
    d0.up = False
    group.migrate("a", {0: [5]}, lost_on="decode-0")
    group.note_outputs(d1, [EngineCoreOutput("a#1", [])])   # no token yet (e.g. prompt log-probabilities)
    assert heard == []
    group.note_outputs(d1, outs("a#1", "a#1"))
    assert len(heard) == 1 and 0 <= heard[0] < 5


def place_prompts(group: EngineGroup, prompts: dict[str, list[int]]) -> list[str]:
    """Add one request a prompt, in order; each one's decode engine."""
    for request_id, tokens in prompts.items():
        group.add_request(Request(request_id, tokens, SamplingParams(max_tokens=4), (0,), 64))
    return [group.placements[r].decode for r in prompts]


SYSTEM_A, SYSTEM_B = list(range(1, 9)), list(range(100, 108))   # two blocks of 4 each


def test_a_prompt_goes_to_the_engine_that_holds_its_start_unless_that_one_is_4_busier():
    group, _, _ = engines(2)
    assert place_prompts(group, {"a": SYSTEM_A + [50], "b": SYSTEM_B + [51]}) == ["decode-0", "decode-1"]
    # B's users follow B to decode-1 (1 token to compute each) while it is less than 4 requests
    # busier than decode-0
    later = {f"b{i}": SYSTEM_B + [60 + i] for i in range(5)}
    assert place_prompts(group, later) == ["decode-1"] * 4 + ["decode-0"]
    assert group.load == {"decode-0": 2, "decode-1": 5}
    assert group.backlog("decode-1") == 9 + 4 and group.backlog("decode-0") == 9 + 9
    # a prompt sharing B's first block: 4 tokens to compute on either, behind 13 or 18
    assert place_prompts(group, {"c": SYSTEM_B[:4] + [9, 9, 9, 9]}) == ["decode-1"]
    # decode-1 is 4 busier now: a prompt goes to decode-0 whatever it holds
    assert place_prompts(group, {"d": SYSTEM_B + [9]}) == ["decode-0"]


def test_a_cached_prefix_loses_to_a_queue_longer_than_computing_the_prompt_elsewhere():
    group, (d0, d1), _ = engines(2)
    assert place_prompts(group, {"x": [5] * 3, "long": [7] * 40}) == ["decode-0", "decode-1"]
    group.prefixes.record("decode-1", group.prefixes.hashes(SYSTEM_B), d1.ready.num_blocks)
    # decode-1 holds B but has 40 tokens to compute first; decode-0 computes all 9 behind 3
    assert place_prompts(group, {"u": SYSTEM_B + [1]}) == ["decode-0"]
    group.note_outputs(d1, outs("long"))   # decode-1's queue is done
    assert place_prompts(group, {"v": SYSTEM_B + [2]}) == ["decode-1"]
    assert group.backlog("decode-1") == 1 and group.backlog("decode-0") == 3 + 9


def test_an_engines_report_of_its_cache_routes_what_this_frontend_never_placed_and_forgets_evictions():
    from duoserve.core.block_pool import hash_block
    from duoserve.frontend.prefix_map import short_hash

    group, _, _ = engines(2)
    first = hash_block(None, SYSTEM_B[:4])   # the engine's own key of SYSTEM_B's first block
    group.prefixes.report("decode-1", [short_hash(first), short_hash(hash_block(first, SYSTEM_B[4:]))])
    assert place_prompts(group, {"x": SYSTEM_B + [1]}) == ["decode-1"], "another frontend's prompt, reported"
    assert place_prompts(group, {"y": SYSTEM_B + [1]}) == ["decode-1"]
    salted = Request("z", SYSTEM_B + [1], SamplingParams(max_tokens=4, cache_salt="tenant"), (0,), 64)
    assert group.prefixes.matched("decode-1", group.prefixes.hashes(salted.prompt_token_ids, "tenant")) == 0, \
        "a salted prompt's blocks are keyed apart, as the engines key them"
    group.prefixes.report("decode-0", [])
    group.prefixes.report("decode-1", [])   # evicted there: only what this frontend placed counts now
    assert group.prefixes.matched("decode-1", group.prefixes.hashes(SYSTEM_B)) == 2


def test_least_loaded_routing_ignores_the_prefixes():
    group, _, _ = engines(2, router=Router(routing="least-loaded"))
    prompts = {f"b{i}": SYSTEM_B + [60 + i] for i in range(4)}
    assert place_prompts(group, prompts) == ["decode-0", "decode-1", "decode-0", "decode-1"]


def test_a_relaunched_engine_is_known_to_hold_nothing_and_the_map_forgets_past_its_pool():
    group, (d0, d1), _ = engines(2)
    place_prompts(group, {"a": SYSTEM_A, "b": SYSTEM_B})
    group.engine_up(d1)   # decode-1 came back: its prefix cache is empty
    assert group.prefixes.matched("decode-1", group.prefixes.hashes(SYSTEM_B)) == 0
    assert group.prefixes.matched("decode-0", group.prefixes.hashes(SYSTEM_A)) == 2
    # decode-0 holds 8 blocks: four more prompts of two blocks push SYSTEM_A's out
    for i in range(4):
        group.prefixes.record("decode-0", group.prefixes.hashes([200 + 10 * i] * 8), d0.ready.num_blocks)
    assert group.prefixes.matched("decode-0", group.prefixes.hashes(SYSTEM_A)) == 0


def test_the_prefill_engine_is_chosen_by_prefix_too_and_the_decode_engine_recorded():
    group, _, prefill = engines(2, 2, Router("cpu"))
    group.add_request(Request("a", SYSTEM_A, SamplingParams(max_tokens=4), (0,), 64))
    group.add_request(Request("b", SYSTEM_B, SamplingParams(max_tokens=4), (0,), 64))
    group.add_request(Request("c", SYSTEM_A + [5], SamplingParams(max_tokens=4), (0,), 64))
    assert [(group.placements[r].prefill, group.placements[r].decode) for r in "abc"] == [
        ("prefill-0", "decode-0"), ("prefill-1", "decode-1"), ("prefill-0", "decode-0")]


def test_a_draining_engine_takes_no_new_work_unless_every_engine_drains():
    group, (d0, d1), _ = engines(2)
    place_prompts(group, {"a": SYSTEM_A})                # decode-0 holds SYSTEM_A, and is least loaded after
    place_prompts(group, {"b": SYSTEM_B, "c": SYSTEM_B + [1]})
    group.release("b")
    d0.draining = True
    assert place_prompts(group, {"d": SYSTEM_A + [2], "e": [9] * 3}) == ["decode-1", "decode-1"]
    d1.draining = True
    assert place_prompts(group, {"f": [8] * 3}) == ["decode-0"], "all draining: work still goes somewhere"


def test_a_drained_prefill_engine_strands_only_what_it_had_not_prefilled():
    """A prefill engine that exits after a drain held every lease until the decode engine had the
    KV: the requests it reported prefilled live on the decode engine; one not yet prefilled (or any,
    after an exit that was no drain) moves."""
    group, _, (p0, _) = engines(2, 2, Router("cpu"))
    place(group, "a", "b", "c")
    assert [group.placements[r].prefill for r in "abc"] == ["prefill-0", "prefill-1", "prefill-0"]
    group.placements["a"].prefilled = True
    assert group.stranded_by(p0) == ["a", "c"], "died: both moved (neither was handed over yet)"
    p0.draining = True
    assert group.stranded_by(p0) == ["c"]


def test_between_equal_engines_a_tenants_requests_are_spread():
    group, _, _ = engines(2)
    for request_id, tenant in (("h1", "heavy"), ("l1", "light"), ("h2", "heavy"), ("l2", "light")):
        group.add_request(Request(request_id, [1, 2, 3], SamplingParams(max_tokens=4, tenant=tenant), (0,), 64))
    # h2 finds both engines equal (one request each) and goes where heavy has none
    assert [group.placements[r].decode for r in ("h1", "l1", "h2", "l2")] == \
        ["decode-0", "decode-1", "decode-1", "decode-0"]
    assert group.tenant_load() == {("decode-0", "heavy"): 1, ("decode-1", "light"): 1,
                                   ("decode-1", "heavy"): 1, ("decode-0", "light"): 1}
    assert group.tenant_load("heavy") == {("decode-0", "heavy"): 1, ("decode-1", "heavy"): 1}


def test_routing_on_kv_events_places_a_prompt_where_the_events_say_its_prefix_is():
    group, _, _ = engines(2, router=Router(routing="kv-events"))
    prompt = list(range(1, 14))   # three full blocks of 4 and a token
    hashes, parent = [], None
    for start in range(0, 12, 4):
        parent = hash_block(parent, prompt[start:start + 4])
        hashes.append(parent)
    group.prefixes.stored("decode-1", hashes)
    group.add_request(Request("a", prompt, SamplingParams(max_tokens=4), (0,), 64))
    assert group.placements["a"].decode == "decode-1"   # the first engine, decode-0, would take a tie
    group.release("a")
    group.prefixes.removed("decode-1", hashes[1:])        # evicted but the first block
    group.prefixes.stored("decode-0", hashes[:2])
    group.add_request(Request("b", prompt, SamplingParams(max_tokens=4), (0,), 64))
    assert group.placements["b"].decode == "decode-0"
    group.prefixes.cleared("decode-0")                     # relaunched: nothing cached there
    group.release("b")
    group.prefixes.report("decode-0", [])                   # reports and placements change nothing
    assert group.prefixes.matched("decode-0", group.prefixes.hashes(prompt)) == 0
    assert group.prefixes.matched("decode-1", group.prefixes.hashes(prompt)) == 1
