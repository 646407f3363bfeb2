"""The frontend's caps on waiting requests (``duoserve.frontend.admission``): per tenant and
server-wide, a Retry-After from the recent start rate, and bounded metrics labels."""

from __future__ import annotations

import pytest

from duoserve.frontend.admission import MAX_CLASS_LABELS, Admission, QueueFullError
from duoserve.sampling_params import SamplingParams


def test_caps_count_requests_until_their_first_output_and_say_when_to_come_back():
    admission = Admission(max_waiting_per_tenant=2, max_waiting=3)
    for rid, tenant in (("a1", "a"), ("a2", "a"), ("b1", "b")):
        admission.check(tenant)
        admission.enter(rid, SamplingParams(tenant=tenant))
    with pytest.raises(QueueFullError, match="tenant 'a' has 2 requests waiting"):
        admission.check("a")
    with pytest.raises(QueueFullError, match="the server has 3 requests waiting") as err:
        admission.check("c")
    assert err.value.retry_after == 1   # nothing started lately: no rate to go by
    for rid in ("a1", "a2", "b1"):
        admission.started(rid)           # three starts in the last 10 s: 0.3 a second
    admission.check("a")
    for i in range(3):
        admission.enter(f"c{i}", SamplingParams(tenant="c"))
    with pytest.raises(QueueFullError) as err:
        admission.check("d")
    assert err.value.retry_after == 10   # 3 waiting at 0.3 a second
    assert admission.refused == {"tenant_waiting": 1, "server_waiting": 2}
    for rid in ("a1", "a2", "b1", "c0", "c1", "c2"):
        admission.leave(rid)
    assert not admission.waiting and not admission.classes


def test_metrics_labels_are_bounded_per_kind():
    admission = Admission()
    for i in range(MAX_CLASS_LABELS + 5):
        admission.enter(f"r{i}", SamplingParams(tenant=f"user-{i}", priority=i % 3))
    counts = admission.counts()
    assert counts[("other", "0")][0] + counts[("other", "1")][0] + counts[("other", "2")][0] == 5
    assert {p for _, p in counts} == {"0", "1", "2"}
    assert ("anonymous", "0") not in counts
    admission.enter("anon", SamplingParams())
    assert ("anonymous", "0") not in admission.counts() and admission.classes["anon"].label == "other"
