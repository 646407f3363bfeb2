"""Tool calls: what each tool_choice asks the engine for, the parsers that read calls out of a
model's text, the streamed deltas reassembled into the whole answer, and the chat template
seeing the tools and a conversation's calls (no model)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from duoserve.entrypoints.protocol import ChatCompletionRequest
from duoserve.entrypoints.tools import ToolStream, for_template, parse_hermes, parse_llama3_json, parse_mistral
from duoserve.errors import ConfigError

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
                                                "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}


def body(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **fields)


def test_each_choice_mode_and_its_grammar():
    assert body().tool_plan(None).mode == "none"
    assert body(tools=[WEATHER], tool_choice="none").tool_plan(None).tools == []   # the model never sees them
    named = body(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}})
    plan = named.tool_plan(None)
    assert plan.mode == "named" and json.loads(plan.grammar().json) == TIME["function"]["parameters"]
    required = body(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False).tool_plan(None)
    schema = json.loads(required.grammar().json)
    jsonschema.validate([{"name": "get_weather", "parameters": {"city": "Oslo"}}], schema)
    for wrong in ([], [{"name": "get_time", "parameters": {}}], [{"name": "get_weather", "parameters": {"city": "a"}}] * 2):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, schema)
    assert body(tools=[WEATHER]).tool_plan("hermes").mode == "auto"


@pytest.mark.parametrize("fields, parser, param, words", [
    ({"tools": [WEATHER]}, None, "tool_choice", "--tool-call-parser"),
    ({"tool_choice": "required"}, None, "tool_choice", "when no tools are given"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, None, "tool_choice",
     "get_weather"),
    ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, None, "tools", "distinct"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, None,
     "response_format", "its own schema"),
])
def test_what_cannot_be_served_is_refused_by_name(fields, parser, param, words):
    with pytest.raises(ConfigError) as info:
        body(**fields).tool_plan(parser)
    assert info.value.field == param and words in str(info.value)


def test_parsers():
    content, calls = parse_hermes('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}'
                                  '\n</tool_call>\n<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}')
    assert content == "Let me check." and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo"}), ("get_time", {"zone": "CET"})]
    assert parse_hermes("no call here") == ("no call here", [])
    assert parse_hermes("<tool_call>{not json}</tool_call>")[1] == []          # stays content
    _, calls = parse_llama3_json('{"name": "get_time", "parameters": {"zone": "UTC"}}')
    assert calls[0].name == "get_time" and json.loads(calls[0].arguments) == {"zone": "UTC"}
    assert parse_llama3_json("Sure: {}") == ("Sure: {}", [])
    content, calls = parse_mistral('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Rome"}}]')
    assert content is None and calls[0].name == "get_weather"
    assert len({c.id for c in parse_hermes('<tool_call>{"name": "a"}</tool_call><tool_call>{"name": "b"}')[1]}) == 2


def reassemble(plan, parser, pieces: list[str]) -> tuple[str | None, list[dict], str]:
    stream = ToolStream(plan, parser)
    deltas = []
    for i, piece in enumerate(pieces):
        deltas += stream.feed(piece, i == len(pieces) - 1)
    content = "".join(d.get("content", "") for d in deltas) or None
    calls: dict[int, dict] = {}
    for d in deltas:
        for part in d.get("tool_calls", ()):
            call = calls.setdefault(part["index"], {"arguments": ""})
            if "id" in part:
                assert call.get("id") is None and part["function"]["arguments"] == "", "id and name come first"
                call.update(id=part["id"], name=part["function"]["name"])
            call["arguments"] += part["function"]["arguments"]
    return content, [calls[i] for i in sorted(calls)], stream.finish_reason("stop")


@pytest.mark.parametrize("text", [
    'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
    '<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call><tool_call>{"name": "get_weather", '
    '"arguments": {"city": "Lima"}}</tool_call>',
    "A plain answer with a < sign and <tool but no call.",
    "<tool_call>{broken</tool_call>",
])
def test_streamed_deltas_reassemble_into_the_whole_answer(text):
    plan = body(tools=[WEATHER, TIME]).tool_plan("hermes")
    whole_content, whole_calls = plan.calls(text, "hermes")
    for size in (1, 3, 7, len(text)):
        content, calls, finish = reassemble(plan, "hermes", [text[i:i + size] for i in range(0, len(text), size)])
        assert content == whole_content
        assert [(c["name"], c["arguments"]) for c in calls] == [(c.name, c.arguments) for c in whole_calls]
        assert finish == ("tool_calls" if whole_calls else "stop")


def test_a_named_call_streams_its_arguments_as_they_come():
    plan = body(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}}).tool_plan(None)
    content, calls, finish = reassemble(plan, None, ['{"city"', ': "Oslo"', "}"])
    assert content is None and calls == [{"id": calls[0]["id"], "name": "get_weather", "arguments": '{"city": "Oslo"}'}]
    assert finish == "stop"   # OpenAI's, for a forced function


def test_the_template_sees_tools_and_a_conversations_calls():
    from tokenizers import Tokenizer as HF, models

    from duoserve.model.tokenizer import Tokenizer

    template = ("{% for t in tools or [] %}TOOL {{ t.function.name }} {{ t.function.parameters | tojson }}{{ '\\n' }}{% endfor %}"
                "{% for m in messages %}{{ m.role }}:{% if m.tool_calls %}{% for c in m.tool_calls %}"
                "CALL {{ c.function.name }} {{ c.function.arguments | tojson }}{% endfor %}{% else %}"
                "{{ m.content }}{% endif %}{% if m.tool_call_id %} ({{ m.tool_call_id }}){% endif %}{{ '\\n' }}{% endfor %}"
                "{% if enable_thinking is defined and not enable_thinking %}NOTHINK{% endif %}")
    tokenizer = Tokenizer(HF(models.BPE()), bos_token_id=None, eos_token_ids=(0,), chat_template=template)
    messages = for_template([
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "content": "12 C", "tool_call_id": "call_1"}])
    text = tokenizer.apply_chat_template(messages, tools=[WEATHER], enable_thinking=False)
    assert text.splitlines() == [
        'TOOL get_weather {"additionalProperties": false, "properties": {"city": {"type": "string"}, "unit": '
        '{"enum": ["C", "F"]}}, "required": ["city"], "type": "object"}',
        "user:Weather in Oslo?", 'assistant:CALL get_weather {"city": "Oslo"}', "tool:12 C (call_1)", "NOTHINK"]
