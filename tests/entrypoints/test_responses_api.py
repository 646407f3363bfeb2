"""OpenAI's Responses API (/v1/responses), through the official openai SDK, unmodified, against
the session's real server: the response object and every event in the shape the Open Responses
specification requires, stored responses and their chains, background responses, compaction, and
the WebSocket mode."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.conftest import API_KEY

MODEL = "smollm2-135m"
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                           "unit": {"enum": ["celsius", "fahrenheit"]}},
                          "required": ["city", "unit"], "additionalProperties": False}}


def test_text_and_usage_match_chat_completions(client):
    response = client.responses.create(model=MODEL, instructions="You are terse.", input="Name a fruit.",
                                       max_output_tokens=20, temperature=0)
    chat = client.chat.completions.create(model=MODEL, max_tokens=20, temperature=0, messages=[
        {"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a fruit."}])
    assert response.object == "response" and response.id.startswith("resp_")
    assert [item.type for item in response.output] == ["message"]
    assert response.output_text == chat.choices[0].message.content
    finish = chat.choices[0].finish_reason
    assert response.status == {"stop": "completed", "length": "incomplete"}[finish]
    assert (response.incomplete_details is not None) == (finish == "length")
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens


def test_items_input_equals_the_chat_conversation(client):
    items = [{"role": "developer", "content": "You are terse."},
             {"role": "user", "content": [{"type": "input_text", "text": "Name a fruit."}]},
             {"role": "assistant", "content": [{"type": "output_text", "text": "Apple."}]},
             {"role": "user", "content": "Another?"}]
    response = client.responses.create(model=MODEL, input=items, max_output_tokens=12, temperature=0)
    chat = client.chat.completions.create(model=MODEL, max_tokens=12, temperature=0, messages=[
        {"role": "developer", "content": "You are terse."}, {"role": "user", "content": "Name a fruit."},
        {"role": "assistant", "content": "Apple."}, {"role": "user", "content": "Another?"}])
    assert response.output_text == chat.choices[0].message.content


def test_stream_events_in_the_apis_order_and_reassembled(client):
    kw = dict(model=MODEL, input="Describe the sea.", max_output_tokens=10, temperature=0)
    whole = client.responses.create(**kw)
    events = list(client.responses.create(**kw, stream=True))
    kinds = [e.type for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * deltas,
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     f"response.{whole.status}"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text
    item_ids = {e.item_id for e in events if hasattr(e, "item_id")}
    assert item_ids == {events[-1].response.output[0].id}
    # the SDK's own accumulator agrees (it reads a response.completed event: an answer that ends)
    kw = dict(model=MODEL, input="Name a fruit.", max_output_tokens=16, temperature=0)
    whole = client.responses.create(**kw)
    assert whole.status == "completed"
    with client.responses.stream(**kw) as stream:
        assert stream.get_final_response().output_text == whole.output_text


@pytest.mark.parametrize("choice", [{"type": "function", "name": "get_weather"}, "required"])
def test_forced_function_call_arguments_validate(client, choice):
    response = client.responses.create(model=MODEL, input="Weather in Paris?", tools=[WEATHER], tool_choice=choice,
                                       max_output_tokens=48, temperature=0)
    calls = [item for item in response.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER["parameters"])
    # streamed: the arguments' deltas add up to the same call
    events = list(client.responses.create(model=MODEL, input="Weather in Paris?", tools=[WEATHER],
                                          tool_choice=choice, max_output_tokens=48, temperature=0, stream=True))
    streamed = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert streamed == calls[0].arguments
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and done[0].arguments == streamed
    # the call and its output go back as items: the conversation goes on
    follow = client.responses.create(model=MODEL, max_output_tokens=8, temperature=0, tools=[WEATHER], input=[
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather", "arguments": calls[0].arguments},
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"}], tool_choice="none")
    assert follow.output_text


def test_json_schema_format_validates(client):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "colour": {"enum": ["red", "green", "yellow"]}},
              "required": ["name", "colour"], "additionalProperties": False}
    response = client.responses.create(model=MODEL, input="A fruit as JSON.", max_output_tokens=60, text={
        "format": {"type": "json_schema", "name": "fruit", "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(response.output_text), schema)


@pytest.mark.parametrize("kw, param", [
    (dict(previous_response_id="resp_123"), "previous_response_id"),
    (dict(extra_body={"conversation": "conv_1"}), "conversation"),
    (dict(include=["file_search_call.results"]), "include.0"),
    (dict(store=False, background=True), "background"),
    (dict(input=[{"type": "function_call_output", "call_id": "call_x", "output": "1"}]), "input.0.call_id"),
    (dict(tools=[{"type": "web_search"}]), "tools.0.type"),
    (dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]),
     "input.0.content.0.type"),
])
def test_what_cannot_be_served_is_refused_by_name(client, kw, param):
    kw = {"input": "hi", **kw}
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=MODEL, max_output_tokens=4, **kw)
    error = caught.value.body
    assert error["param"] == param and param.split(".")[0] in error["message"] or param in error["message"], error


# The response object as the Open Responses specification requires it (its ResponseResource):
# every field present, numbers where it says number, null only where it allows null.
NUMBER, INTEGER, STRING = {"type": "number"}, {"type": "integer"}, {"type": "string"}
RESPONSE_SCHEMA = {"type": "object", "required": [
    "id", "object", "created_at", "completed_at", "status", "incomplete_details", "model", "previous_response_id",
    "instructions", "output", "error", "tools", "tool_choice", "truncation", "parallel_tool_calls", "text", "top_p",
    "presence_penalty", "frequency_penalty", "top_logprobs", "temperature", "reasoning", "usage",
    "max_output_tokens", "max_tool_calls", "store", "background", "service_tier", "metadata",
    "safety_identifier", "prompt_cache_key"], "properties": {
    "object": {"const": "response"}, "created_at": INTEGER, "completed_at": {"type": ["integer", "null"]},
    "top_p": NUMBER, "temperature": NUMBER, "presence_penalty": NUMBER, "frequency_penalty": NUMBER,
    "top_logprobs": INTEGER, "parallel_tool_calls": {"type": "boolean"}, "store": {"type": "boolean"},
    "background": {"type": "boolean"}, "service_tier": STRING, "truncation": {"enum": ["auto", "disabled"]},
    "max_output_tokens": {"type": ["integer", "null"]}, "max_tool_calls": {"type": ["integer", "null"]},
    "tools": {"type": "array", "items": {"type": "object", "required": ["type", "name", "description", "parameters",
                                                                        "strict"]}},
    "reasoning": {"type": ["object", "null"]}, "text": {"type": "object", "required": ["format"]},
    "usage": {"type": ["object", "null"], "required": ["input_tokens", "output_tokens", "total_tokens",
                                                       "input_tokens_details", "output_tokens_details"]}}}


def test_the_response_object_and_its_events_have_every_field_the_spec_requires(client):
    kw = dict(model=MODEL, input="Name a fruit.", max_output_tokens=6, temperature=0, tools=[WEATHER])
    response = client.responses.create(**kw)
    jsonschema.validate(response.model_dump(), RESPONSE_SCHEMA)
    assert response.completed_at >= response.created_at and response.top_p == 1.0 and response.store
    events = list(client.responses.create(**kw, stream=True))
    for event in events:
        if hasattr(event, "response"):
            jsonschema.validate(event.response.model_dump(), RESPONSE_SCHEMA)
    assert events[0].response.completed_at is None and events[-1].response.completed_at is not None


def test_a_stored_response_chains_gets_lists_and_deletes(client):
    first = client.responses.create(model=MODEL, input="Name a fruit.", max_output_tokens=8, temperature=0)
    second = client.responses.create(model=MODEL, previous_response_id=first.id, input="Another?",
                                     max_output_tokens=8, temperature=0)
    chat = client.chat.completions.create(model=MODEL, max_tokens=8, temperature=0, messages=[
        {"role": "user", "content": "Name a fruit."}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "Another?"}])
    assert second.previous_response_id == first.id and second.output_text == chat.choices[0].message.content
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert client.responses.retrieve(second.id).output_text == second.output_text
    items = client.responses.input_items.list(second.id)
    assert [(i.type, i.role, i.content[0].text) for i in items.data] == [("message", "user", "Another?")]
    assert items.data[0].id.startswith("msg_")
    assert client.responses.delete(second.id) is None   # the SDK reads the deletion and returns nothing
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(second.id)
    unstored = client.responses.create(model=MODEL, input="hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=MODEL, previous_response_id=unstored.id, input="again", max_output_tokens=2)
    assert caught.value.body["code"] == "previous_response_not_found"


def test_a_function_calls_output_follows_it_through_previous_response_id(client):
    call = client.responses.create(model=MODEL, input="Weather in Paris?", tools=[WEATHER], max_output_tokens=48,
                                   temperature=0, tool_choice={"type": "function", "name": "get_weather"})
    (item,) = [i for i in call.output if i.type == "function_call"]
    follow = client.responses.create(model=MODEL, previous_response_id=call.id, tools=[WEATHER], tool_choice="none",
                                     max_output_tokens=8, temperature=0, input=[
                                         {"type": "function_call_output", "call_id": item.call_id, "output": "sunny"}])
    assert follow.status in ("completed", "incomplete") and follow.output_text


def test_a_background_response_is_polled_and_cancelled(client):
    import time

    queued = client.responses.create(model=MODEL, input="Count to a thousand.", background=True,
                                     max_output_tokens=6, temperature=0)
    assert queued.status == "queued" and queued.background
    for _ in range(600):   # bounded by polls, not seconds
        polled = client.responses.retrieve(queued.id)
        if polled.status not in ("queued", "in_progress"):
            break
        time.sleep(0.05)
    foreground = client.responses.create(model=MODEL, input="Count to a thousand.", max_output_tokens=6, temperature=0)
    assert polled.status == foreground.status and polled.output_text == foreground.output_text
    long = client.responses.create(model=MODEL, input="Count to a thousand.", background=True, max_output_tokens=4000,
                                   extra_body={"ignore_eos": True})
    cancelled = client.responses.cancel(long.id)
    assert cancelled.status == "cancelled" and client.responses.retrieve(long.id).status == "cancelled"
    with pytest.raises(openai.BadRequestError):
        client.responses.cancel(foreground.id)


def test_compaction_folds_a_conversation_into_one_item_a_later_request_unfolds(client, server):
    import httpx

    conversation = [{"role": "user", "content": "Name a fruit."}, {"role": "assistant", "content": "Apple."},
                    {"role": "user", "content": "Another?"}]
    reply = httpx.post(f"{server.url}/v1/responses/compact", headers={"Authorization": f"Bearer {API_KEY}"},
                       json={"model": MODEL, "input": conversation[:2]}, timeout=60)
    assert reply.status_code == 200, reply.text
    compacted = reply.json()
    assert compacted["object"] == "response.compaction" and [i["type"] for i in compacted["output"]] == ["compaction"]
    after = client.responses.create(model=MODEL, input=[*compacted["output"], conversation[2]], max_output_tokens=8,
                                    temperature=0)
    whole = client.responses.create(model=MODEL, input=conversation, max_output_tokens=8, temperature=0)
    assert after.output_text == whole.output_text and after.usage.input_tokens == whole.usage.input_tokens
    missing = httpx.post(f"{server.url}/v1/responses/compact", headers={"Authorization": f"Bearer {API_KEY}"},
                         json={"input": conversation[:2]}, timeout=60)
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "model"


def test_the_websocket_mode_runs_turns_and_keeps_its_connections_responses(server):
    import asyncio

    import websockets

    url, auth = server.url.replace("http", "ws", 1) + "/v1/responses", {"Authorization": f"Bearer {API_KEY}"}

    async def turn(ws, **fields) -> list[dict]:
        await ws.send(json.dumps({"type": "response.create", "model": MODEL, "max_output_tokens": 6,
                                  "temperature": 0, **fields}))
        events = []
        while not events or events[-1]["type"] not in ("response.completed", "response.incomplete",
                                                        "response.failed", "error"):
            events.append(json.loads(await ws.recv()))
        return events

    async def scenario():
        async with websockets.connect(url, additional_headers=auth) as ws:
            first = await turn(ws, input="Name a fruit.", store=False)
            assert [e["sequence_number"] for e in first] == list(range(len(first)))
            jsonschema.validate(first[-1]["response"], RESPONSE_SCHEMA)
            rid = first[-1]["response"]["id"]
            second = await turn(ws, input="Another?", previous_response_id=rid, store=False)
            assert second[-1]["type"] in ("response.completed", "response.incomplete")
            failed = await turn(ws, previous_response_id=rid, input=[
                {"type": "function_call_output", "call_id": "call_missing", "output": "1"}])
            assert failed[-1]["type"] == "error" and failed[-1]["error"]["param"] == "input.0.call_id"
            gone = await turn(ws, previous_response_id=rid, input="again")   # a failed continuation forgets it
            assert gone[-1]["error"]["code"] == "previous_response_not_found" and gone[-1]["status"] == 400
            second_id = second[-1]["response"]["id"]
        async with websockets.connect(url, additional_headers=auth) as ws:   # store: false stays on its socket
            other = await turn(ws, previous_response_id=second_id, input="again")
            assert other[-1]["error"]["code"] == "previous_response_not_found"
            assert (await turn(ws, input="hi"))[-1]["type"] in ("response.completed", "response.incomplete")
        with pytest.raises(websockets.exceptions.InvalidStatus):
            async with websockets.connect(url):   # no key: refused before it opens
                pass

    asyncio.run(scenario())
    chat = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY).chat.completions.create(
        model=MODEL, max_tokens=6, temperature=0, messages=[{"role": "user", "content": "Name a fruit."}])
    assert chat.choices[0].message.content is not None


def test_truncation_auto_drops_the_oldest_items_that_do_not_fit(client):
    long = [{"role": "user", "content": "hello " * 9000}, {"role": "assistant", "content": "Hi."},
            {"role": "user", "content": "Name a fruit."}]
    with pytest.raises(openai.BadRequestError):   # the context is 8192 tokens
        client.responses.create(model=MODEL, input=long, max_output_tokens=4, temperature=0)
    fitted = client.responses.create(model=MODEL, input=long, max_output_tokens=4, temperature=0, truncation="auto")
    alone = client.responses.create(model=MODEL, input=long[1:], max_output_tokens=4, temperature=0)
    assert fitted.truncation == "auto" and fitted.output_text == alone.output_text
    assert fitted.usage.input_tokens == alone.usage.input_tokens


def test_included_logprobs_match_chat_completions(client):
    kw = dict(model=MODEL, max_output_tokens=5, temperature=0)
    response = client.responses.create(**kw, input="Name a fruit.", top_logprobs=2,
                                       include=["message.output_text.logprobs"])
    chat = client.chat.completions.create(model=MODEL, max_tokens=5, temperature=0, logprobs=True, top_logprobs=2,
                                          messages=[{"role": "user", "content": "Name a fruit."}])
    entries = response.output[0].content[0].logprobs
    assert [(e.token, e.logprob, len(e.top_logprobs)) for e in entries] == [
        (e.token, e.logprob, 2) for e in chat.choices[0].logprobs.content]
    streamed = [e for e in client.responses.create(**kw, input="Name a fruit.", top_logprobs=2, stream=True,
                                                   include=["message.output_text.logprobs"])
                if e.type == "response.output_text.delta"]
    assert [lp.token for e in streamed for lp in e.logprobs] == [e.token for e in entries]
