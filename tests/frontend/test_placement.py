"""Placement by predicted time to first token (``duoserve.frontend.placement``), from recorded
rates: the choice, the prediction, the fallback, and the router's backlogs behind them."""

from __future__ import annotations

import pytest

from duoserve.core.rates import BATCH_SIZES, PROMPT_SIZES, lookup
from duoserve.frontend.placement import Choice, Rates, choose
from duoserve.frontend.router import Router
from tests.frontend.test_router import engines, outs, place


def flat(prefill_tokens_per_s: float, decode_step_s: float, handoff_s_per_token: float = 0.0) -> Rates:
    """Rates measured alike at every size."""
    return Rates((prefill_tokens_per_s,) * len(PROMPT_SIZES), (decode_step_s,) * len(BATCH_SIZES),
                 handoff_s_per_token)


# rates an engine of the default model reported on a 2-core Xeon (session 23): prompt tokens a
# second with both cores, a step of 4 decodes, and the KV handoff per prompt token
MEASURED = flat(490.0, 0.02, 0.0001)


def test_a_long_prompt_is_never_prefilled_where_it_would_hold_up_decodes():
    # 512 tokens (the step budget's worth) at 490 a second stall the decodes 1.04 s > 0.2 s
    choice = choose(1500, MEASURED, 0, MEASURED, 0, step_budget=512, max_stall=0.2, max_prefill_len=512)
    assert choice == Choice(True, pytest.approx(1500 / 490 + 1500 * 0.0001))


def test_a_short_prompt_goes_where_it_gets_its_first_token_first():
    # the prefill engine is busy with a long prompt: the decode engine takes the short one
    choice = choose(64, MEASURED, 0, MEASURED, 1500, 512, 0.2, 512)
    assert choice == Choice(False, pytest.approx(64 / 490 + 0.02))
    # the decode engine has prompts of its own queued and the prefill engine is idle: remote
    choice = choose(64, MEASURED, 400, MEASURED, 0, 512, 0.2, 512)
    assert choice == Choice(True, pytest.approx(64 / 490 + 64 * 0.0001))
    # idle both: the handoff (6.4 ms) costs less than a decode step (20 ms)
    assert choose(64, MEASURED, 0, MEASURED, 0, 512, 0.2, 512).remote


def test_prompts_queued_on_a_decode_engine_go_in_the_step_that_would_hold_up_its_decodes():
    # 128 queued + 64: one step of 192 tokens stalls the decodes 392 ms <= 400
    assert choose(64, MEASURED, 128, MEASURED, 1500, 512, 0.4, 512) == Choice(False, pytest.approx(192 / 490 + 0.02))
    # 160 queued + 64: 457 ms > 400, however short the prompt itself: the prefill engine takes it
    assert choose(64, MEASURED, 160, MEASURED, 1500, 512, 0.4, 512).remote


def test_an_engine_not_measured_yet_is_taken_to_run_at_the_other_roles_rate():
    unmeasured = Rates()
    assert choose(64, unmeasured, 0, MEASURED, 1500, 512, 0.2, 512) == Choice(False, pytest.approx(64 / 490))
    assert choose(1500, MEASURED, 0, unmeasured, 0, 512, 0.2, 512) == Choice(True, pytest.approx(1500 / 490))


def test_before_any_rate_the_threshold_decides():
    unmeasured = Rates()
    assert choose(512, unmeasured, 0, unmeasured, 0, 512, 0.2, 512) == Choice(True, None)
    assert choose(513, unmeasured, 0, unmeasured, 0, 512, 0.2, 512) == Choice(False, None)


def test_with_no_prefill_engine_up_the_decode_engine_prefills():
    assert choose(1500, MEASURED, 0, None, 0, 512, 0.2, 512) == Choice(False, None)
    assert choose(64, MEASURED, 0, None, 0, 512, 0.2, 512) == Choice(False, pytest.approx(64 / 490 + 0.02))


def test_a_prompt_is_predicted_from_the_part_each_engine_probably_lacks():
    # 1,472 of 1,500 tokens cached on the decode engine: 28 to compute stall the decodes 57 ms
    choice = choose(1500, MEASURED, 0, MEASURED, 0, 512, 0.2, 512, local_cached=1472)
    assert choice == Choice(False, pytest.approx(28 / 490 + 0.02))
    # cached on the prefill engine: the handoff still sends every block
    choice = choose(1500, MEASURED, 0, MEASURED, 0, 512, 0.2, 512, remote_cached=1472)
    assert choice == Choice(True, pytest.approx(28 / 490 + 1500 * 0.0001))


def test_rates_are_kept_by_step_size_and_an_unmeasured_size_takes_the_nearest():
    assert PROMPT_SIZES == (32, 128, 512, 2048) and BATCH_SIZES == (1, 2, 4, 8, 16, 32, 64)
    rates = (0.0, 300.0, 0.0, 500.0)
    assert [lookup(rates, PROMPT_SIZES, n) for n in (1, 64, 200, 511, 512, 3000)] == [300, 300, 300, 300, 300, 500]
    assert lookup((0.0,) * 4, PROMPT_SIZES, 64) == 0.0


def test_a_prompt_is_predicted_at_the_rate_of_the_step_it_fills_and_the_decodes_beside_it():
    # short steps run at 250 tokens a second, full ones at 490; one decode 10 ms, 8 of them 30 ms
    rates = Rates((250.0, 250.0, 490.0, 490.0), (0.01, 0.01, 0.01, 0.03, 0.03, 0.03, 0.03), 0.0001)
    assert choose(64, rates, 0, rates, 1500, 512, 0.4, 512, local_decodes=1) == \
        Choice(False, pytest.approx(64 / 250 + 0.01))
    assert choose(64, rates, 0, rates, 1500, 512, 0.4, 512, local_decodes=8) == \
        Choice(False, pytest.approx(64 / 250 + 0.03))
    # behind a queue a step is full: 64 tokens behind 1,000 go at 490 (locally, 64 alone at 250
    # would stall the decodes 256 ms > 200)
    assert choose(64, rates, 0, rates, 1000, 512, 0.2, 512) == Choice(True, pytest.approx(1064 / 490 + 0.0064))
    assert choose(64, rates, 1000, rates, 0, 512, 0.4, 512) == Choice(True, pytest.approx(64 / 250 + 0.0064))
    assert choose(1500, rates, 0, rates, 1000, 512, 0.2, 512) == Choice(True, pytest.approx(2500 / 490 + 0.15))


def test_the_router_places_by_prediction_with_backlogs_counted_from_its_placements():
    group, (decode,), (prefill,) = engines(1, 1, Router("auto", max_prefill_len=512, step_budget=512, max_stall=0.2))
    decode.rates = prefill.rates = MEASURED
    seen = []
    group.on_first_token.append(lambda remote, predicted, measured: seen.append((remote, predicted)))
    assert place(group, "long", num_tokens=1500) == [("prefill-0", "decode-0")]
    assert group.backlog("prefill-0") == 1500 and group.backlog("decode-0") == 0
    assert place(group, "short", num_tokens=64) == [(None, "decode-0")], "behind a long prompt: local"
    assert group.backlog("decode-0") == 64
    group.note_outputs(decode, outs("short"))       # its first token: no backlog left
    assert group.backlog("decode-0") == 0 and seen == [(False, pytest.approx(64 / 490 + 0.02))]
    group.note_outputs(prefill, outs("long"))
    assert group.backlog("prefill-0") == 0
    assert seen[1] == (True, pytest.approx(1500 / 490 + 0.15))
    assert place(group, "next", num_tokens=64) == [("prefill-0", "decode-0")], "both idle: remote"


def test_a_prefill_engine_is_predicted_to_take_the_shortest_prompt_first():
    group, (decode,), (prefill,) = engines(1, 1, Router("auto", max_prefill_len=512, step_budget=512, max_stall=0.4))
    decode.rates = prefill.rates = MEASURED
    place(group, "long", num_tokens=1500)
    place(group, "short", num_tokens=64)
    place(group, "mid", num_tokens=300)
    assert [group.placements[r].prefill for r in ("long", "short", "mid")] == ["prefill-0", None, "prefill-0"]
    # before a new 64-token prompt: nothing shorter, of the longer ones the step under way
    assert group.backlog("prefill-0", 64) == 512
    # before a 400-token one: the 300-token prompt, then a step of the long one's 1,500
    assert group.backlog("prefill-0", 400) == 300 + 512
    assert group.backlog("prefill-0") == 1800 and group.backlog("decode-0") == 64
    # the decode engine's queue (64) and this prompt (200) would stall its decodes 539 ms > 400:
    # remote, behind a step of the longer prompts (1,800 tokens of them)
    seen = []
    group.on_first_token.append(lambda remote, predicted, measured: seen.append((remote, predicted)))
    assert place(group, "next", num_tokens=200) == [("prefill-0", "decode-0")]
    group.note_outputs(prefill, outs("next"))
    assert seen == [(True, pytest.approx((512 + 200) / 490 + 200 * 0.0001))]


def test_every_prompt_goes_remote_unless_auto():
    group, (decode,), (prefill,) = engines(1, 1, Router("cpu"))
    decode.rates = prefill.rates = MEASURED
    assert place(group, "a", "b", num_tokens=64) == [("prefill-0", "decode-0")] * 2
    group.on_first_token.append(lambda *args: pytest.fail("no prediction was made"))
    group.note_outputs(prefill, outs("a"))


def test_each_prediction_and_its_error_are_metrics():
    from duoserve.metrics import ServerMetrics

    metrics = ServerMetrics()
    metrics.observe_prediction(True, 3.0, 3.5)
    metrics.observe_prediction(False, 0.2, 0.1)
    value = metrics.registry.get_sample_value
    assert value("duoserve:placement_predicted_ttft_seconds_sum", {"prefill": "remote"}) == 3.0
    # negative buckets: Prometheus keeps no sum for such a histogram, the buckets say it all
    assert value("duoserve:placement_ttft_error_seconds_bucket", {"prefill": "remote", "le": "0.5"}) == 1
    assert value("duoserve:placement_ttft_error_seconds_bucket", {"prefill": "remote", "le": "0.2"}) == 0
    assert value("duoserve:placement_ttft_error_seconds_bucket", {"prefill": "local", "le": "-0.1"}) == 1
    assert value("duoserve:placement_ttft_error_seconds_bucket", {"prefill": "local", "le": "-0.2"}) == 0


def test_a_prefill_engines_step_is_its_own_budget_and_a_decode_engines_its_own():
    # rates that differ by step size: 300 tokens a second in steps of up to 192, 600 beyond
    sized = Rates(tuple(300.0 if size <= 192 else 600.0 for size in PROMPT_SIZES), (0.02,) * len(BATCH_SIZES))
    # a decode engine computes a long prompt in steps of 192 (0.64 s <= 0.8: offered), at 300/s;
    # the prefill engine in steps of 512, at 600/s: remote, predicted at its own rate
    choice = choose(1500, sized, 0, sized, 0, step_budget=192, max_stall=0.8, max_prefill_len=512, remote_budget=512)
    assert choice == Choice(True, pytest.approx(1500 / 600))
    # the prefill engine taken to step by the decode engine's budget: predicted at 300/s, twice as long
    assert choose(1500, sized, 0, sized, 0, step_budget=192, max_stall=0.8, max_prefill_len=512) == \
        Choice(True, pytest.approx(1500 / 300))
