"""Tenants on a real server (``--scheduling-policy fair``, two API keys): each key is a tenant in
the metrics, a tenant over ``--max-waiting-per-tenant`` gets 429 with Retry-After while another is
served, a light tenant goes before a heavy tenant's backlog, and a request waiting past its
``timeout`` gets 503 with Retry-After before its prompt is computed."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from duoserve.entrypoints.tenants import key_tenant
from tests.server_helpers import Server, metric, wait_gauges_idle

KEYS = ("alpha-key", "beta-key")
LONG = {"prompt": "Tell me a long story", "max_tokens": 48, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = Server("--dtype", "float32", "--quantization", "none", "--kv-cache-memory", "0.1", "--num-threads", "2",
                 "--scheduling-policy", "fair", "--max-num-seqs", "1", "--max-waiting-per-tenant", "3",
                 api_key=",".join(KEYS), log=tmp_path_factory.mktemp("tenants") / "server.log")
    yield srv
    srv.stop()


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _metric(server, name: str, labels: dict | None = None) -> float:
    return metric(server.url, name, labels, auth(KEYS[0]))


async def _post(http: httpx.AsyncClient, key: str, body: dict, delay: float = 0.0) -> tuple[httpx.Response, float]:
    await asyncio.sleep(delay)
    response = await http.post("/v1/completions", json=body, headers=auth(key))
    return response, time.monotonic()


def test_each_key_is_a_tenant_and_a_tenant_over_its_cap_gets_429_while_another_is_served(server):
    refused_before = _metric(server, "duoserve:requests_refused_total", {"reason": "tenant_waiting"})

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as http:
            alpha = [_post(http, KEYS[0], LONG) for _ in range(8)]
            beta = _post(http, KEYS[1], {**LONG, "max_tokens": 8}, delay=0.5)   # behind alpha's backlog
            return await asyncio.gather(*alpha, beta)

    results = asyncio.run(main())
    alpha, (beta, beta_done) = results[:8], results[8]
    refused = [r for r, _ in alpha if r.status_code == 429]
    served = [(r, t) for r, t in alpha if r.status_code == 200]
    # one running, three waiting: the rest refused, each saying when to come back
    assert len(served) >= 3 and len(refused) == 8 - len(served) and refused
    assert all(1 <= int(r.headers["retry-after"]) <= 60 for r in refused)
    body = refused[0].json()["error"]
    assert body["type"] == "rate_limit_error" and "--max-waiting-per-tenant 3" in body["message"]
    assert key_tenant(KEYS[0]) in body["message"] and KEYS[0] not in body["message"]
    # beta's request, arriving behind alpha's backlog, finished before alpha's last
    assert beta.status_code == 200 and beta_done < max(t for _, t in served)
    wait_gauges_idle(server.url, within=120, headers=auth(KEYS[0]))
    assert _metric(server, "duoserve:requests_refused_total", {"reason": "tenant_waiting"}) - refused_before \
        == len(refused)
    for key, completions in ((KEYS[0], served), (KEYS[1], [(beta, beta_done)])):
        tokens = sum(r.json()["usage"]["completion_tokens"] for r, _ in completions)
        labels = {"tenant": key_tenant(key), "priority": "0", "kind": "generation"}
        assert _metric(server, "duoserve:class_tokens_total", labels) >= tokens
        assert _metric(server, "duoserve:class_time_to_first_token_seconds_count",
                       {"tenant": key_tenant(key)}) >= len(completions)


def test_a_request_waiting_past_its_timeout_gets_503_before_its_prompt_is_computed(server):
    prompt_before = _metric(server, "duoserve:prompt_tokens_total")

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as http:
            busy = _post(http, KEYS[0], {**LONG, "max_tokens": 64})
            late = _post(http, KEYS[1], {**LONG, "prompt": "A prompt of its own", "timeout": 0.2}, delay=0.3)
            return await asyncio.gather(busy, late)

    (busy, _), (late, _) = asyncio.run(main())
    assert busy.status_code == 200
    assert late.status_code == 503 and 1 <= int(late.headers["retry-after"]) <= 60
    error = late.json()["error"]
    assert error["code"] == "queue_timeout" and error["param"] == "timeout"
    assert "past its timeout of 0.2s" in error["message"]
    wait_gauges_idle(server.url, within=120, headers=auth(KEYS[0]))
    # only the busy request's prompt was counted: the dropped one never reached a prompt step
    assert _metric(server, "duoserve:prompt_tokens_total") - prompt_before == busy.json()["usage"]["prompt_tokens"]
    assert _metric(server, "duoserve:requests_refused_total", {"reason": "timeout"}) == 1


def test_the_user_field_names_no_tenant_where_keys_do(server):
    """With several keys, a client cannot pass for another tenant by writing ``user``."""
    def prompt_tokens(key: str) -> float:
        return _metric(server, "duoserve:class_tokens_total", {"tenant": key_tenant(key), "kind": "prompt"})

    alpha_before, beta_before = prompt_tokens(KEYS[0]), prompt_tokens(KEYS[1])
    response = httpx.post(f"{server.url}/v1/completions", headers=auth(KEYS[1]), timeout=120,
                          json={"prompt": "hi", "max_tokens": 2, "user": key_tenant(KEYS[0])})
    assert response.status_code == 200
    assert prompt_tokens(KEYS[0]) == alpha_before
    assert prompt_tokens(KEYS[1]) - beta_before == response.json()["usage"]["prompt_tokens"]
    text = httpx.get(f"{server.url}/metrics", headers=auth(KEYS[0])).text
    assert "alpha-key" not in text and "beta-key" not in text


def _families(text: str) -> dict[str, list]:
    from prometheus_client.parser import text_string_to_metric_families
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def test_the_gauges_routers_read_agree_with_duoserves_own(server):
    """vLLM's gauge names (what llm-d's and KServe's routers read), per engine and model, equal
    duoserve's own in the same scrape, busy and idle."""
    import threading

    async def burst():
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as http:
            await asyncio.gather(*(_post(http, KEYS[0], LONG) for _ in range(3)))

    sender = threading.Thread(target=lambda: asyncio.run(burst()))
    sender.start()
    pairs = (("vllm:num_requests_running", "duoserve:num_requests_running"),
             ("vllm:num_requests_waiting", "duoserve:num_requests_waiting"),
             ("vllm:kv_cache_usage_perc", "duoserve:kv_cache_usage_ratio"))
    seen_busy = False
    while sender.is_alive() or not seen_busy:
        families = _families(httpx.get(f"{server.url}/metrics", headers=auth(KEYS[0])).text)
        for theirs, ours in pairs:
            samples = families[theirs]
            assert {s.labels["model_name"] for s in samples} == {"smollm2-135m"}
            assert {s.labels["engine"] for s in samples} == {"engine-0"}
            assert sum(s.value for s in samples) == sum(s.value for s in families[ours])
        seen_busy |= sum(s.value for s in families["vllm:num_requests_waiting"]) > 0
        if not sender.is_alive() and not seen_busy:
            raise AssertionError("the burst ended before a scrape saw a request waiting")
        time.sleep(0.05)
    sender.join()
    wait_gauges_idle(server.url, within=120, headers=auth(KEYS[0]))
    families = _families(httpx.get(f"{server.url}/metrics", headers=auth(KEYS[0])).text)
    assert all(s.value == 0 for theirs, _ in pairs for s in families[theirs])
