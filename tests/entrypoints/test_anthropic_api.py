"""Anthropic's Messages API (/v1/messages), through the official anthropic SDK, unmodified,
against the session's real server (its key sent as x-api-key, as the SDK does)."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest

from tests.conftest import API_KEY

MODEL = "smollm2-135m"
GREEDY = {"temperature": 0}   # today's SDK sends no sampling fields: raw HTTP's, as an extra field
WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"},
                                                             "unit": {"enum": ["celsius", "fahrenheit"]}},
                            "required": ["city", "unit"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=600)


def test_text_and_usage_match_chat_completions(claude, client):
    messages = [{"role": "user", "content": "Name a fruit."}]
    message = claude.messages.create(model=MODEL, max_tokens=20, messages=messages, extra_body=GREEDY)
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0)
    assert message.type == "message" and message.role == "assistant" and message.model == MODEL
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text == chat.choices[0].message.content
    assert message.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[chat.choices[0].finish_reason]
    usage = message.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == chat.usage.prompt_tokens
    assert usage.output_tokens == chat.usage.completion_tokens


def test_stream_reassembles_to_the_message(claude):
    kw = dict(model=MODEL, max_tokens=12, system="You are terse.",
              messages=[{"role": "user", "content": "Describe the sea."}], extra_body=GREEDY)
    whole = claude.messages.create(**kw)
    kinds = []
    with claude.messages.stream(**kw) as stream:
        for event in stream:
            kinds.append(event.type)
        final = stream.get_final_message()
    text_events = [k for k in kinds if k in ("message_start", "content_block_start", "content_block_stop",
                                             "message_delta", "message_stop")]
    assert text_events == ["message_start", "content_block_start", "content_block_stop", "message_delta",
                           "message_stop"]
    assert final.content[0].text == whole.content[0].text
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens


def test_system_prompt_reaches_the_model(claude, client):
    system = "Answer in French."
    messages = [{"role": "user", "content": "What is bread?"}]
    message = claude.messages.create(model=MODEL, max_tokens=16, system=[{"type": "text", "text": system}],
                                     messages=messages, extra_body=GREEDY)
    chat = client.chat.completions.create(model=MODEL, max_tokens=16, temperature=0,
                                          messages=[{"role": "system", "content": system}, *messages])
    assert message.content[0].text == chat.choices[0].message.content
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == chat.usage.prompt_tokens
    # Claude Code style: the system prompt as a message of its own, joined to the one in ``system``
    inline = claude.messages.create(model=MODEL, max_tokens=16, extra_body=GREEDY, system="Be brief.", messages=[
        {"role": "system", "content": system}, *messages])
    chat = client.chat.completions.create(model=MODEL, max_tokens=16, temperature=0,
                                          messages=[{"role": "system", "content": f"Be brief.\n\n{system}"}, *messages])
    assert inline.content[0].text == chat.choices[0].message.content


def test_a_tool_use_loop_with_no_tool_choice(claude):
    """The SDK's loop as an agent runs it: tools and no tool_choice (auto), the calls answered with
    tool_result blocks until the model answers in text, or the turns run out (the default model,
    greedy, asks again after a result: an agent's turn limit ends its loop); every call names a
    tool and its input validates."""
    tools = [WEATHER, {"name": "get_time", "description": "The time in a city", "input_schema": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    used = []
    for _ in range(4):   # bounded turns
        message = claude.messages.create(model=MODEL, max_tokens=64, tools=tools, messages=messages, extra_body=GREEDY)
        calls = [b for b in message.content if b.type == "tool_use"]
        assert (message.stop_reason == "tool_use") == bool(calls)
        if not calls:
            break
        for call in calls:
            jsonschema.validate(call.input, next(t["input_schema"] for t in tools if t["name"] == call.name))
        used += [call.name for call in calls]
        messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in message.content]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": c.id, "content": "sunny, 21 C"}
                                                  for c in calls]}]
    assert used and used[0] == "get_weather"


@pytest.mark.parametrize("choice", [{"type": "tool", "name": "get_weather"}, {"type": "any"}])
def test_forced_tool_call_input_validates(claude, choice):
    message = claude.messages.create(model=MODEL, max_tokens=48, tools=[WEATHER], tool_choice=choice,
                                     messages=[{"role": "user", "content": "Weather in Paris?"}])
    calls = [block for block in message.content if block.type == "tool_use"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].id.startswith("toolu_")
    jsonschema.validate(calls[0].input, WEATHER["input_schema"])
    assert message.stop_reason == "tool_use"
    # the call and its result go back: the conversation goes on
    follow = claude.messages.create(model=MODEL, max_tokens=8, tools=[WEATHER], extra_body=GREEDY, messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": calls[0].id, "name": "get_weather",
                                           "input": calls[0].input}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": calls[0].id, "content": "sunny"}]}],
        tool_choice={"type": "none"})
    assert follow.content and follow.usage.output_tokens > 0


def test_streamed_tool_call_matches_the_whole(claude):
    kw = dict(model=MODEL, max_tokens=48, tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"},
              messages=[{"role": "user", "content": "Weather in Oslo?"}], extra_body=GREEDY)
    whole = claude.messages.create(**kw)
    with claude.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    assert [(b.type, b.name, b.input) for b in final.content] == [(b.type, b.name, b.input) for b in whole.content]


def test_output_config_format_validates(claude):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "colour": {"enum": ["red", "green", "yellow"]}},
              "required": ["name", "colour"], "additionalProperties": False}
    message = claude.messages.create(model=MODEL, max_tokens=60, output_config={"format": {
        "type": "json_schema", "schema": schema}}, messages=[{"role": "user", "content": "A fruit as JSON."}])
    jsonschema.validate(json.loads(message.content[0].text), schema)


def test_count_tokens_equals_the_prompts_usage(claude):
    kw = dict(model=MODEL, system="You are terse.", messages=[{"role": "user", "content": "Count these words."}])
    counted = claude.messages.count_tokens(**kw)
    message = claude.messages.create(max_tokens=1, **kw)
    assert counted.input_tokens == message.usage.input_tokens + message.usage.cache_read_input_tokens > 5


def test_a_final_assistant_message_is_continued(claude, client):
    said = "The capital of France is"
    message = claude.messages.create(model=MODEL, max_tokens=4, extra_body=GREEDY, messages=[
        {"role": "user", "content": "Tell me about Paris."}, {"role": "assistant", "content": said}])
    chat = client.chat.completions.create(model=MODEL, max_tokens=4, temperature=0, messages=[
        {"role": "user", "content": "Tell me about Paris."}, {"role": "assistant", "content": said}],
        extra_body={"continue_final_message": True, "add_generation_prompt": False})
    assert message.content[0].text == chat.choices[0].message.content
    assert not message.content[0].text.startswith(said)


def test_stop_sequence_is_named(claude):
    plain = claude.messages.create(model=MODEL, max_tokens=20, extra_body=GREEDY,
                                   messages=[{"role": "user", "content": "Name a fruit."}])
    word = plain.content[0].text.split()[2]
    stopped = claude.messages.create(model=MODEL, max_tokens=20, extra_body=GREEDY, stop_sequences=[word],
                                     messages=[{"role": "user", "content": "Name a fruit."}])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == word
    assert stopped.content[0].text == plain.content[0].text[:plain.content[0].text.index(word)]


@pytest.mark.parametrize("kw, status, words", [
    (dict(messages=[{"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "media_type": "image/png", "data": "AA=="}}]}]), 400, ("'image'", "messages.0.content.0")),
    (dict(messages=[{"role": "user", "content": "hi"}], extra_body={"container": "c1"}), 400, ("'container'",)),
    (dict(messages=[{"role": "user", "content": "hi"}], thinking={"type": "enabled", "budget_tokens": 1024}),
     400, ("thinking", "--reasoning-parser")),
    (dict(messages=[{"role": "user", "content": "hi"}], tools=[{"type": "web_search_20250305", "name": "web_search"}]),
     400, ("web_search_20250305", "tools.0.type")),
    (dict(messages=[]), 400, ("messages",)),
])
def test_bad_requests_get_anthropics_error_shape(claude, kw, status, words):
    with pytest.raises(anthropic.APIStatusError) as caught:
        claude.messages.create(model=MODEL, max_tokens=8, **kw)
    assert caught.value.status_code == status
    body = caught.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert all(w in body["error"]["message"] for w in words), body


def test_missing_max_tokens_and_wrong_key_in_anthropics_shape(server):
    r = httpx.post(f"{server.url}/v1/messages", headers={"x-api-key": API_KEY},
                   json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}, timeout=600)
    assert r.status_code == 400 and r.json() == {"type": "error", "error": {
        "type": "invalid_request_error", "message": "invalid value for max_tokens: Field required"}}
    r = httpx.post(f"{server.url}/v1/messages", headers={"x-api-key": "wrong"}, timeout=600,
                   json={"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = httpx.post(f"{server.url}/v1/messages", headers={"x-api-key": API_KEY}, timeout=600,
                   json={"model": "claude-sonnet-4-5", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
