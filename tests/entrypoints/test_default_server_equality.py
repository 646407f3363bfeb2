"""The first thing a new user tries, on ``duoserve serve`` with no model flags (the packaged GGUF
file computed from its blocks, ``--dtype auto``): the same greedy chat request through the openai
SDK, answered whole and then streamed, gives the same text, though the second finds the prompt's
blocks in the prefix cache and computes only the rest. Then what an extraction client sends: a
``response_format`` JSON schema (whole and streamed: one valid document), vLLM's
``structured_outputs`` on completions, and a schema that cannot be enforced refused with its
``param``. Colocated and disaggregated, the SDK unmodified."""

from __future__ import annotations

import json
import signal

import jsonschema
import openai
import pytest
from openai import OpenAI

from tests.server_helpers import Server

SYSTEM = ("You are a careful assistant. Answer in plain English, in full sentences, and say so when you do "
          "not know. Keep every answer short, and never use lists.")
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                         "country": {"type": "string", "maxLength": 30},
                                         "population_millions": {"type": "integer", "minimum": 0, "maximum": 40}},
        "required": ["city", "country", "population_millions"], "additionalProperties": False}


@pytest.fixture(scope="module", params=["colocated", "disaggregated"])
def client(request, tmp_path_factory):
    srv = Server("--mode", request.param, "--kv-cache-memory", "0.2", "--max-model-len", "1024",
                 log=tmp_path_factory.mktemp(request.param) / "log")
    try:
        yield OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0, timeout=600)
    finally:
        assert srv.stop() in (0, -signal.SIGTERM)


def model_of(client: OpenAI) -> str:
    (model,) = [m.id for m in client.models.list()]
    return model


def test_a_greedy_request_answered_whole_then_streamed_gives_one_text(client):
    request = dict(model=model_of(client), temperature=0, max_tokens=40,
                   messages=[{"role": "system", "content": SYSTEM},
                             {"role": "user", "content": "Why is the sky blue?"}])
    whole = client.chat.completions.create(**request)
    assert whole.usage.prompt_tokens_details.cached_tokens == 0
    chunks = list(client.chat.completions.create(**request, stream=True, stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content
    usage = chunks[-1].usage
    assert usage.completion_tokens == whole.usage.completion_tokens
    # every full block of the prompt came from the cache; its last token is always computed
    assert usage.prompt_tokens_details.cached_tokens == (whole.usage.prompt_tokens - 1) // 16 * 16 > 0


def test_structured_outputs_through_the_sdk(client):
    model = model_of(client)
    request = dict(model=model, temperature=0, max_tokens=80,
                   messages=[{"role": "user", "content": "Tell me about Paris as JSON."}],
                   response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": CITY,
                                                                           "strict": True}})
    whole = client.chat.completions.create(**request)
    text = whole.choices[0].message.content
    jsonschema.validate(json.loads(text), CITY)
    assert whole.choices[0].finish_reason == "stop"
    chunks = list(client.chat.completions.create(**request, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    seeded = client.chat.completions.create(**{**request, "temperature": 1.0, "seed": 4, "n": 3})
    for choice in seeded.choices:
        jsonschema.validate(json.loads(choice.message.content), CITY)
    choice = client.completions.create(model=model, prompt="The capital of Italy is", max_tokens=10, temperature=0,
                                       extra_body={"structured_outputs": {"choice": ["Rome", "Milan", "Turin"]}})
    assert choice.choices[0].text in ("Rome", "Milan", "Turin") and choice.choices[0].finish_reason == "stop"
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(**{**request, "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "array", "uniqueItems": True}}}})
    assert refused.value.param == "response_format.json_schema.schema" and "uniqueItems" in refused.value.message
