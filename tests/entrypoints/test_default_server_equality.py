"""The first thing a new user tries, on ``duoserve serve`` with no model flags (the packaged GGUF
file computed from its blocks, ``--dtype auto``): the same greedy chat request through the openai
SDK, answered whole and then streamed, gives the same text, though the second finds the prompt's
blocks in the prefix cache and computes only the rest. Then what an extraction client sends: a
``response_format`` JSON schema (whole and streamed: one valid document), vLLM's
``structured_outputs`` on completions, and a schema that cannot be enforced refused with its
``param``; and what an agent sends: tools with each tool_choice (named, required, auto read by the
hermes parser), whole and streamed deltas alike. Colocated and disaggregated, the SDK unmodified."""

from __future__ import annotations

import json
import signal

import anthropic
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
                 "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3",
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


def test_every_api_gives_the_chat_routes_greedy_text(client):
    """Anthropic's Messages and OpenAI's Responses are translations of the chat request at the
    edge: the same conversation, greedy, is the same text through each SDK (and so is its
    stream), colocated and disaggregated."""
    model = model_of(client)
    question = [{"role": "user", "content": "Why is the sky blue?"}]
    chat = client.chat.completions.create(model=model, temperature=0, max_tokens=32,
                                          messages=[{"role": "system", "content": SYSTEM}, *question])
    text = chat.choices[0].message.content
    root = str(client.base_url).rstrip("/").removesuffix("/v1")
    claude = anthropic.Anthropic(base_url=root, api_key="none", max_retries=0, timeout=600)
    kw = dict(model=model, max_tokens=32, system=SYSTEM, messages=question, extra_body={"temperature": 0})
    assert claude.messages.create(**kw).content[0].text == text
    with claude.messages.stream(**kw) as stream:
        assert "".join(stream.text_stream) == text
    kw = dict(model=model, instructions=SYSTEM, input=question, max_output_tokens=32, temperature=0)
    assert client.responses.create(**kw).output_text == text
    events = client.responses.create(**kw, stream=True)
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == text


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
    # sampled, room for the longest document the schema allows (two 30-character strings, each
    # character a token at worst): a sample ends by the grammar, not by max_tokens
    seeded = client.chat.completions.create(**{**request, "temperature": 1.0, "seed": 4, "n": 3, "max_tokens": 160})
    for choice in seeded.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), CITY)
    choice = client.completions.create(model=model, prompt="The capital of Italy is", max_tokens=10, temperature=0,
                                       extra_body={"structured_outputs": {"choice": ["Rome", "Milan", "Turin"]}})
    assert choice.choices[0].text in ("Rome", "Milan", "Turin") and choice.choices[0].finish_reason == "stop"
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(**{**request, "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "array", "uniqueItems": True}}}})
    assert refused.value.param == "response_format.json_schema.schema" and "uniqueItems" in refused.value.message


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "maxLength": 20},
                                                "unit": {"enum": ["celsius", "fahrenheit"]}},
                                                "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
    "additionalProperties": False}}}
# what a Hermes-style model writes for a call (forced here by a grammar: the small default model
# has no tool format of its own), for the parser to read back
HERMES_CALL = r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{2,9}", "unit": "celsius"\}\}</tool_call>'


def streamed_calls(chunks) -> tuple[str, list[dict], str]:
    content, calls, finish = "", {}, None
    for chunk in chunks:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for part in delta.tool_calls or ():
            call = calls.setdefault(part.index, {"id": None, "name": None, "arguments": ""})
            if part.id:
                assert call["id"] is None and part.function.name, "index, id and name come first"
                call.update(id=part.id, name=part.function.name)
            call["arguments"] += part.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


def test_tool_calls_through_the_sdk(client):
    model = model_of(client)
    request = dict(model=model, temperature=0, max_tokens=80, tools=[WEATHER, CLOCK],
                   messages=[{"role": "user", "content": "What is the weather in Lisbon?"}])
    parameters = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, CLOCK)}
    for choice, finish in (({"type": "function", "function": {"name": "get_weather"}}, "stop"), ("required", "tool_calls")):
        whole = client.chat.completions.create(**request, tool_choice=choice)
        message = whole.choices[0].message
        assert whole.choices[0].finish_reason == finish and message.content is None
        assert message.tool_calls and all(c.id.startswith("call_") for c in message.tool_calls)
        for call in message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), parameters[call.function.name])
        content, calls, streamed_finish = streamed_calls(
            client.chat.completions.create(**request, tool_choice=choice, stream=True))
        assert content == "" and streamed_finish == finish
        assert [(c["name"], c["arguments"]) for c in calls] == [
            (c.function.name, c.function.arguments) for c in message.tool_calls]
    forced = dict(**request, tool_choice="auto", extra_body={"structured_outputs": {"regex": HERMES_CALL}})
    whole = client.chat.completions.create(**forced)
    (call,) = whole.choices[0].message.tool_calls
    assert whole.choices[0].finish_reason == "tool_calls" and whole.choices[0].message.content is None
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["unit"] == "celsius"
    content, calls, finish = streamed_calls(client.chat.completions.create(**forced, stream=True))
    assert (content, finish) == ("", "tool_calls") and [(c["name"], c["arguments"]) for c in calls] == [
        (call.function.name, call.function.arguments)]
    free = client.chat.completions.create(**request, tool_choice="none")
    assert free.choices[0].message.tool_calls is None and free.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(**request, tool_choice={"type": "function", "function": {"name": "nope"}})
    assert refused.value.param == "tool_choice"


def test_reasoning_is_split_from_the_answer(client):
    """The qwen3 parser: what the model writes in <think>...</think> is reasoning_content (the
    small default model has no thinking of its own: a grammar makes it write some); an answer
    that does not open with <think> is content only."""
    request = dict(model=model_of(client), temperature=0, max_tokens=60,
                   messages=[{"role": "user", "content": "What is two plus two?"}],
                   extra_body={"structured_outputs": {"regex": r"<think>\n[a-z ]{5,40}\n</think>\n\n[A-Z][a-z ]{2,30}\."}})
    whole = client.chat.completions.create(**request)
    message = whole.choices[0].message
    reasoning, content = message.model_extra["reasoning_content"], message.content
    assert reasoning and "<think>" not in reasoning and "\n" not in reasoning
    assert content and content[0].isupper() and content.endswith(".") and "think>" not in content
    chunks = list(client.chat.completions.create(**request, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas) == reasoning
    assert message.model_extra["reasoning"] == reasoning   # the newer name, beside the old one
    assert "".join(d.model_extra.get("reasoning") or "" for d in deltas) == reasoning
    assert "".join(d.content or "" for d in deltas) == content
    plain = client.chat.completions.create(**{**request, "extra_body": {}})
    assert plain.choices[0].message.model_extra["reasoning_content"] is None and plain.choices[0].message.content
