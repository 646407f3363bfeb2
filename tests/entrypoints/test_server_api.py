"""The OpenAI-compatible server, through the official openai SDK and plain HTTP."""

from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import openai
import pytest
import torch

from tests.conftest import API_KEY
from tests.server_helpers import metric, wait_gauges_idle, wait_metric

MODEL = "smollm2-135m"
PROMPT = "The three primary colors are"


def test_completion_greedy_stream_equals_non_stream(client):
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0)
    assert full.object == "text_completion" and len(full.choices) == 1
    pieces, finish = [], None
    for chunk in client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stream=True):
        for choice in chunk.choices:
            pieces.append(choice.text)
            finish = choice.finish_reason or finish
    assert "".join(pieces) == full.choices[0].text
    assert finish == full.choices[0].finish_reason


def test_chat_stream_carries_every_tokens_logprobs(client):
    """A token whose text is held back (it might start a stop string) still gets its
    log-probabilities, in the chunk that carries its text."""
    messages = [{"role": "user", "content": "Describe the sea in one sentence."}]
    kw = dict(model=MODEL, messages=messages, max_tokens=24, temperature=0, logprobs=True, top_logprobs=2,
              stop=[" the", "."])
    full = client.chat.completions.create(**kw)
    want = [entry.token for entry in full.choices[0].logprobs.content]
    assert len(want) == full.usage.completion_tokens
    got, text = [], []
    for chunk in client.chat.completions.create(**kw, stream=True):
        for choice in chunk.choices:
            text.append(choice.delta.content or "")
            got += [entry.token for entry in (choice.logprobs.content if choice.logprobs else [])]
    assert "".join(text) == full.choices[0].message.content
    assert got == want


def test_completion_matches_offline_engine_and_usage(client, smol_llm):
    from duoserve import SamplingParams

    want = smol_llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0]
    got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0)
    assert got.choices[0].text == want.outputs[0].text
    tokenizer = smol_llm.get_tokenizer()
    assert got.usage.prompt_tokens == len(tokenizer.encode(PROMPT))
    assert got.usage.completion_tokens == len(want.outputs[0].token_ids)
    assert got.usage.total_tokens == got.usage.prompt_tokens + got.usage.completion_tokens


def test_four_prompt_forms(client, smol_llm):
    ids = smol_llm.get_tokenizer().encode("Hello there")
    for prompt, count in [("Hello there", 1), (["Hello there", "Goodbye"], 2), (ids, 1), ([ids, ids[:1]], 2)]:
        out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, n=2)
        assert sorted(c.index for c in out.choices) == list(range(2 * count))
    same = client.completions.create(model=MODEL, prompt=ids, max_tokens=5, temperature=0)
    text = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=5, temperature=0)
    assert same.choices[0].text == text.choices[0].text


def test_chat_streamed_and_not(client, smol_llm):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a fruit."}]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0)
    assert full.choices[0].message.role == "assistant"
    tokenizer = smol_llm.get_tokenizer()
    prompt_ids = tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)
    assert full.usage.prompt_tokens == len(prompt_ids)
    roles, content, usage = [], [], None
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.role:
                roles.append(choice.delta.role)
            content.append(choice.delta.content or "")
    assert roles == ["assistant"]
    assert "".join(content) == full.choices[0].message.content
    assert usage.prompt_tokens == full.usage.prompt_tokens and usage.completion_tokens == full.usage.completion_tokens


def test_prompt_logprobs_match_transformers(client, hf_default_model):
    hf_tokenizer, hf = hf_default_model
    text = "The quick brown fox jumps over the lazy dog"
    out = client.completions.create(model=MODEL, prompt=text, max_tokens=0, echo=True, logprobs=1, temperature=0)
    lp = out.choices[0].logprobs
    ids = hf_tokenizer(text)["input_ids"]
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    assert lp.token_logprobs[0] is None and len(lp.token_logprobs) == len(ids)
    for i in range(1, len(ids)):
        assert abs(lp.token_logprobs[i] - ref[i - 1, ids[i]].item()) < 1e-4
    assert "".join(lp.tokens) == text and out.choices[0].text == text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(ids))]
    assert len(lp.top_logprobs[1]) == 1


def test_sampling_extras_and_unknown_fields_accepted(client):
    out = client.completions.create(model=MODEL, prompt="Count: 1, 2,", max_tokens=6, temperature=0.8, seed=3,
                                    extra_body={"top_k": 20, "min_p": 0.05, "min_tokens": 6, "ignore_eos": True,
                                                "repetition_penalty": 1.1, "some_new_field": {"x": 1}})
    again = client.completions.create(model=MODEL, prompt="Count: 1, 2,", max_tokens=6, temperature=0.8, seed=3,
                                      extra_body={"top_k": 20, "min_p": 0.05, "min_tokens": 6, "ignore_eos": True,
                                                  "repetition_penalty": 1.1})
    assert out.usage.completion_tokens == 6 and out.choices[0].text == again.choices[0].text


def _post(server, path: str, body: dict, key: str | None = API_KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{server.url}{path}", json=body, headers=headers, timeout=60)


def _assert_error(resp: httpx.Response, status: int, param: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    if param is not None:
        assert error["param"] == param
    return error


def test_errors_have_openai_shape_and_status(server):
    _assert_error(_post(server, "/v1/completions", {"prompt": "x", "temperature": -1}), 400, "temperature")
    _assert_error(_post(server, "/v1/completions", {"prompt": "x", "n": "many"}), 400, "n")
    _assert_error(_post(server, "/v1/completions", {"max_tokens": 3}), 400, "prompt")
    error = _assert_error(_post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 9000}), 400, "max_tokens")
    assert "8192" in error["message"] and "9001" in error["message"]
    _assert_error(_post(server, "/v1/completions", {"prompt": "x", "model": "gpt-9"}), 404, "model")
    _assert_error(_post(server, "/v1/chat/completions", {"messages": []}), 400, "messages")
    error = _assert_error(_post(server, "/v1/chat/completions", {"messages": [{"role": "user"}]}), 400)
    assert "a message with role 'user' needs 'content'" in error["message"]
    _assert_error(_post(server, "/v1/completions", {"prompt": [1, 10**9]}), 400, "prompt")
    _assert_error(_post(server, "/v1/completions", {"prompt": "x" * (1 << 20)}), 413)
    _assert_error(_post(server, "/v1/completions", {"prompt": "x"}, key=None), 401)
    _assert_error(_post(server, "/v1/completions", {"prompt": "x"}, key="wrong"), 401)
    assert httpx.get(f"{server.url}/health").status_code == 200  # no key needed
    assert httpx.get(f"{server.url}/v1/models").status_code == 401
    # and the server still serves
    assert _post(server, "/v1/completions", {"prompt": "x", "max_tokens": 2}).status_code == 200


def test_sdk_raises_typed_errors(client):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", top_p=1.5)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x")


def test_models_tokenize_detokenize(server, smol_llm):
    models = httpx.get(f"{server.url}/v1/models", headers=server.headers).json()
    assert models["data"][0]["id"] == MODEL and models["data"][0]["max_model_len"] == 8192
    tokens = _post(server, "/tokenize", {"prompt": "Hello <|im_start|>"}).json()
    assert tokens["tokens"] == smol_llm.get_tokenizer().encode("Hello <|im_start|>")
    assert tokens["count"] == len(tokens["tokens"])
    assert _post(server, "/detokenize", {"tokens": tokens["tokens"]}).json()["prompt"] == "Hello <|im_start|>"
    chat = _post(server, "/tokenize", {"messages": [{"role": "user", "content": "Hi"}]}).json()
    assert chat["count"] > 5


def test_generate_route(server):
    body = {"prompt": PROMPT, "max_tokens": 10, "temperature": 0}
    out = _post(server, "/generate", body).json()
    assert set(out) == {"text", "token_ids", "finish_reason", "usage"}
    assert len(out["token_ids"]) == out["usage"]["completion_tokens"] == 10
    assert not out["text"].startswith(PROMPT)
    with httpx.stream("POST", f"{server.url}/generate", json={**body, "stream": True}, headers=server.headers) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line[6:]) for line in lines[:-1]]
    assert "".join(e["text"] for e in events) == out["text"]
    assert sum((e["token_ids"] for e in events), []) == out["token_ids"]


def _metric(server, name: str, labels: dict | None = None) -> float:
    return metric(server.url, name, labels, server.headers)


def test_metrics_parse_and_move(server, client):
    before = _metric(server, "duoserve:generation_tokens_total")
    ttft_before = _metric(server, "duoserve:time_to_first_token_seconds_count")
    placed = {"prefill_engine": "local", "decode_engine": "engine-0"}
    placed_before = _metric(server, "duoserve:request_placements_total", placed)
    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0)
    assert _metric(server, "duoserve:generation_tokens_total") - before == 5
    assert _metric(server, "duoserve:time_to_first_token_seconds_count") == ttft_before + 1
    assert _metric(server, "duoserve:request_placements_total", placed) == placed_before + 1
    assert _metric(server, "duoserve:request_success_total", {"finish_reason": "length"}) >= 1
    # the engine's own counters come with its next stats message
    wait_metric(server.url, "duoserve:prefix_cache_queries_total", lambda v: v > 0, headers=server.headers)
    assert _metric(server, "duoserve:ttft_stage_seconds_count", {"stage": "queue"}) >= 1
    text = httpx.get(f"{server.url}/metrics", headers=server.headers).text
    for name in ["duoserve:time_per_output_token_seconds", "duoserve:inter_token_latency_seconds",
                 "duoserve:e2e_request_latency_seconds", "duoserve:kv_transfer_seconds",
                 "duoserve:num_requests_running", "duoserve:num_requests_waiting", "duoserve:kv_cache_usage_ratio",
                 "duoserve:prompt_tokens_total", "duoserve:prefix_cache_hits_total",
                 "duoserve:kv_transfer_bytes_total"]:
        assert name in text, name


def test_structured_output_metrics_move(server, client):
    names = ["duoserve:structured_output_mask_steps_total", "duoserve:structured_output_mask_seconds_total"]
    before = {n: _metric(server, n) for n in names}
    grammars = _metric(server, "duoserve:structured_output_grammars_total", {"result": "compiled"})
    accepted = _metric(server, "duoserve:structured_output_requests_total", {"result": "accepted"})
    refused = _metric(server, "duoserve:structured_output_requests_total", {"result": "refused"})
    suffix = str(time.monotonic_ns() % 10**6)
    started = time.monotonic()
    pattern = f"[a-z]{{3}}-{suffix}"    # a grammar new to this server
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0,
                                    extra_body={"structured_outputs": {"regex": pattern}})
    assert out.choices[0].finish_reason == "stop" and re.fullmatch(f"[a-z]{{3}}-{suffix}", out.choices[0].text)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5,
                                  extra_body={"structured_outputs": {"regex": "(unclosed"}})
    elapsed = time.monotonic() - started
    # the engine's counters come with its next stats message
    wait_metric(server.url, names[0], lambda v: v - before[names[0]] >= out.usage.completion_tokens,
                headers=server.headers)
    assert _metric(server, "duoserve:structured_output_grammars_total", {"result": "compiled"}) == grammars + 1
    assert _metric(server, "duoserve:structured_output_requests_total", {"result": "accepted"}) == accepted + 1
    assert _metric(server, "duoserve:structured_output_requests_total", {"result": "refused"}) == refused + 1
    steps = _metric(server, names[0]) - before[names[0]]
    assert steps == out.usage.completion_tokens, "one masked step a token"
    assert 0 < _metric(server, names[1]) - before[names[1]] < elapsed, "the masks took part of the requests' time"
    assert _metric(server, "duoserve:structured_output_compile_seconds_total") > 0


def _wait_idle(server) -> None:
    """No request running, waiting or leased, no block held (120 s only guards against a hang)."""
    wait_gauges_idle(server.url, within=120, headers=server.headers)


@pytest.mark.parametrize("route, body", [
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 2000}),
    ("/v1/messages", {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 2000}),
    ("/v1/responses", {"model": MODEL, "input": PROMPT, "max_output_tokens": 2000}),
])
def test_disconnect_mid_stream_frees_blocks(server, route, body):
    """Whichever API the stream speaks, a client leaving aborts its request."""
    generated = _metric(server, "duoserve:generation_tokens_total")
    body = {**body, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}{route}", json=body, headers=server.headers, timeout=60) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 6:
                break  # leave mid-stream
    _wait_idle(server)
    assert _metric(server, "duoserve:generation_tokens_total") < generated + 2000, "aborted, not run to the end"


def test_32_concurrent_streams_complete(server):
    async def one(http: httpx.AsyncClient, i: int) -> str:
        body = {"prompt": f"Story number {i}:", "max_tokens": 16, "ignore_eos": True, "stream": True,
                "temperature": 0.7, "seed": i}
        text, done = "", False
        async with http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    text += json.loads(line[6:])["choices"][0]["text"]
        assert done
        return text

    async def main() -> list[str]:
        async with httpx.AsyncClient(base_url=server.url, headers=server.headers, timeout=180) as http:
            return await asyncio.gather(*(one(http, i) for i in range(32)))

    texts = asyncio.run(main())
    assert len(texts) == 32 and all(texts)
    _wait_idle(server)


def test_full_queue_gets_429_with_retry_after(server):
    async def main() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, headers=server.headers, timeout=180) as http:
            body = {"prompt": "x", "max_tokens": 64, "ignore_eos": True}
            return await asyncio.gather(*(http.post("/v1/completions", json=body) for _ in range(48)))

    responses = asyncio.run(main())
    refused = [r for r in responses if r.status_code == 429]
    assert refused, [r.status_code for r in responses]
    # the seconds the waiting requests take to start at the recent rate (1 with none started lately)
    assert all(1 <= int(r.headers["retry-after"]) <= 60 for r in refused)
    _assert_error(refused[0], 429)
    assert all(r.status_code in (200, 429) for r in responses)
    _wait_idle(server)


@pytest.mark.parametrize("route,body", [
    ("/v1/completions", {"prompt": PROMPT}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}]}),
    ("/generate", {"prompt": PROMPT}),
])
def test_non_streamed_request_is_aborted_when_its_client_leaves(server, route, body):
    """A client that gives up on a long non-streamed answer (curl -m 2) frees the engine at once."""
    before = _metric(server, "duoserve:generation_tokens_total")
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{server.url}{route}", json={**body, "max_tokens": 3000, "ignore_eos": True},
                   headers=server.headers, timeout=2)
    wait_gauges_idle(server.url, within=120, headers=server.headers)   # a hang guard, not a speed bound
    generated = _metric(server, "duoserve:generation_tokens_total")
    assert generated < before + 3000, "the request was aborted, not run to its 3,000 tokens"
    time.sleep(0.5)
    assert _metric(server, "duoserve:generation_tokens_total") == generated, "nothing generates for nobody"


def test_first_contact_api_errors(server):
    """Bad JSON, unknown routes and methods, and an over-long chat, in OpenAI's error shape."""
    bad = httpx.post(f"{server.url}/v1/completions", content=b'{"prompt": "x", "max_tokens": }',
                     headers={**server.headers, "content-type": "application/json"})
    error = _assert_error(bad, 400, param=None)
    assert error["param"] is None and error["message"].startswith("the request body is not valid JSON at character")
    error = _assert_error(httpx.get(f"{server.url}/v1/nothing", headers=server.headers), 404)
    assert error["message"] == "no route GET /v1/nothing"
    error = _assert_error(httpx.get(f"{server.url}/v1/completions", headers=server.headers), 405)
    assert error["message"] == "GET is not allowed on /v1/completions"
    long_chat = {"messages": [{"role": "user", "content": "word " * 9000}], "max_tokens": 1}
    error = _assert_error(_post(server, "/v1/chat/completions", long_chat), 400, "messages")
    assert "context length (max_model_len) is 8192" in error["message"]


def test_chat_message_has_refusal_field(server):
    out = _post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
    message = out.json()["choices"][0]["message"]
    assert message["refusal"] is None and message["role"] == "assistant"


def test_a_priority_is_refused_by_name_where_the_server_serves_in_arrival_order(client):
    """vLLM's rule: a priority other than 0 needs --scheduling-policy priority (this server: fcfs)."""
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       extra_body={"priority": 3})
    assert err.value.body["param"] == "priority" and "--scheduling-policy priority" in err.value.body["message"]
    ok = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, extra_body={"priority": 0})
    assert ok.usage.completion_tokens == 2
