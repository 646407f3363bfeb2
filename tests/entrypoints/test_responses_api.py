"""OpenAI's Responses API (/v1/responses), through the official openai SDK, unmodified, against
the session's real server."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

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
    (dict(store=True), "store"),
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
