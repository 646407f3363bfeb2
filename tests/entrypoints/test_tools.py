"""Tool calls: what each tool_choice asks the engine for, the parsers that read calls out of a
model's text, the format found from a chat template (and the generic one for a template without
tools), the lazy grammar of ``auto`` over the default model's vocabulary, the streamed deltas
reassembled into the whole answer, and the chat template seeing the tools and a conversation's calls."""

from __future__ import annotations

import json

import jsonschema
import pytest

from duoserve.entrypoints.protocol import ChatCompletionRequest
from duoserve.entrypoints.tool_formats import render_generic, tool_format
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
    assert body().tool_plan().mode == "none"
    assert body(tools=[WEATHER], tool_choice="none").tool_plan().tools == []   # the model never sees them
    named = body(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}})
    plan = named.tool_plan()
    assert plan.mode == "named" and json.loads(plan.grammar().json) == TIME["function"]["parameters"]
    required = body(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False).tool_plan()
    schema = json.loads(required.grammar().json)
    jsonschema.validate([{"name": "get_weather", "parameters": {"city": "Oslo"}}], schema)
    for wrong in ([], [{"name": "get_time", "parameters": {}}], [{"name": "get_weather", "parameters": {"city": "a"}}] * 2):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, schema)
    auto = body(tools=[WEATHER]).tool_plan()
    assert auto.mode == "auto" and auto.parser == "hermes" and auto.grammar().param == "tools"
    assert body(tools=[WEATHER]).tool_plan("mistral").grammar() is None   # opened by a special token: read only
    assert body(tools=[WEATHER], response_format={"type": "json_object"}).tool_plan().grammar() is None


@pytest.mark.parametrize("fields, parser, param, words", [
    ({"tool_choice": "required"}, None, "tool_choice", "when no tools are given"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, None, "tool_choice",
     "get_weather"),
    ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, None, "tools", "distinct"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, None,
     "response_format", "its own schema"),
])
def test_what_cannot_be_served_is_refused_by_name(fields, parser, param, words):
    with pytest.raises(ConfigError) as info:
        body(**fields).tool_plan()
    assert info.value.field == param and words in str(info.value)


def test_calls_written_as_fenced_or_bare_json_are_read_too():
    names = ("get_weather", "get_time")
    content, calls = parse_hermes('Calling it.\n```json\n{"name": "get_weather", "parameters": {"city": "Oslo"}}\n```',
                                  names)
    assert content == "Calling it." and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo"})]
    content, calls = parse_hermes(' {"name": "get_time", "arguments": {"zone": "UTC"}}\n\n'
                                  '{"name": "get_weather", "arguments": {"city": "Lima"}}', names)
    assert content is None and [c.name for c in calls] == ["get_time", "get_weather"]
    content, calls = parse_hermes('To get it:\n[{"name": "get_weather", "arguments": {"city": "Rome"}}, '
                                  '{"name": "get_time", "arguments": {"zone": "CET"}}]', names)
    assert content == "To get it:" and [c.name for c in calls] == ["get_weather", "get_time"]
    assert parse_hermes('The object {"name": "x"} is JSON', names) == ('The object {"name": "x"} is JSON', [])
    assert parse_hermes('```json\n{"name": "get_time", "arguments": {"zone"', names)[1] == []   # cut short: content


def test_the_format_comes_from_the_chat_template():
    assert tool_format("{% if tools %}...<tool_call>\n{\"name\": <function-name>}...{% endif %}") == "hermes"
    assert tool_format("{{ bos }}[AVAILABLE_TOOLS]{{ tools }}[TOOL_CALLS]") == "mistral"
    assert tool_format("{%- if tools %}<|python_tag|>{% endif %}") == "llama3_json"
    assert tool_format("{% for m in messages %}{{ m.content }}{% endfor %}") == "generic"   # shows no tools
    assert tool_format(None) == "generic"


def test_the_generic_format_shows_the_tools_calls_and_results_to_a_template_without_tools():
    messages = render_generic([
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Oslo and Lima?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}},
            {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Lima"}}}]},
        {"role": "tool", "content": "12 C", "tool_call_id": "c1"}, {"role": "tool", "content": "20 C", "tool_call_id": "c2"}],
        [WEATHER], auto=True)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    system = messages[0]["content"]
    assert system.startswith("Be brief.\n\nYou can call") and '"name": "get_weather"' in system
    assert system.endswith('or {"response": "..."} to reply to the user.')
    assert json.loads(messages[2]["content"]) == {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo"}},
                                                                 {"name": "get_weather", "arguments": {"city": "Lima"}}]}
    assert messages[3]["content"] == "Result of get_weather: 12 C\nResult of get_weather: 20 C"
    named = render_generic([{"role": "user", "content": "hi"}], [WEATHER], auto=False)
    assert named[0]["role"] == "system" and "response" not in named[0]["content"]   # one added, no JSON asked


@pytest.mark.parametrize("text, content, calls", [
    ('{"response": "Hello \\"you\\" \\u00e9"}', 'Hello "you" \u00e9', []),
    ('{"response": "cut sho', "cut sho", []),                                 # max_tokens
    ('{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "get_time", "arguments": '
     '{"zone": "CET"}}]}', None, [("get_weather", {"city": "Oslo"}), ("get_time", {"zone": "CET"})]),
    ('{"tool_calls": [{"name": "get_weather", "arguments": {"ci', '{"tool_calls": [{"name": "get_weather", "arguments": {"ci', []),
])
def test_the_generic_answer_is_read_whole_and_streamed(text, content, calls):
    plan = body(tools=[WEATHER, TIME]).tool_plan("generic")
    assert plan.grammar().kind == "json"
    whole_content, whole_calls = plan.calls(text)
    assert whole_content == content and [(c.name, json.loads(c.arguments)) for c in whole_calls] == calls
    for size in (1, 2, 5, len(text)):
        streamed, streamed_calls, finish = reassemble(plan, [text[i:i + size] for i in range(0, len(text), size)])
        assert streamed == content and [c["name"] for c in streamed_calls] == [name for name, _ in calls]
        assert finish == ("tool_calls" if calls else "stop")


@pytest.fixture(scope="module")
def vocabulary():
    import llguidance

    from duoserve.model.gguf_file import read_gguf
    from duoserve.model.paths import default_model_path
    from duoserve.model.tokenizer import tokenizer_from_gguf
    from duoserve.structured.grammar import GrammarCompiler

    tokenizer = tokenizer_from_gguf(read_gguf(default_model_path()).meta, (2,))
    return tokenizer, GrammarCompiler(tokenizer, 49152, (2,)).ll_tokenizer, llguidance


@pytest.mark.parametrize("parallel, text, whole", [
    (True, "Sure, the answer is 4.", True),
    (True, "Use ```python\nprint(1)\n``` or <tool but not a call.", True),
    (True, '{"a": 1} is JSON', True),
    (True, 'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', True),
    (True, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n'
           '{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>', True),
    (False, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>', False),
    (True, 'Here:\n```json\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n```', True),
    (True, ' {"name": "get_time", "arguments": {"zone": "UTC"}}\n{"name": "get_weather", "arguments": {"city": "Oslo"}}', True),
    (True, 'To get it:\n{"name": "get_weather", "arguments": {"city": "Paris"}}', True),
    (True, '[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {"zone": "CET"}}]',
     True),
    (True, '```json\n[{"name": "get_time", "arguments": {"zone": "UTC"}}]\n```', True),
    (True, 'The object {"name": "Bob"} is not a call.', True),
    (False, '{"name": "get_time", "arguments": {"zone": "UTC"}}\n{', False),
    (True, '<tool_call>\n{"name": "get_clock"', False),                      # no such tool
    (True, '{"name": "get_time", "arguments": {"zone": "UTC"}} and more', False),   # calls end the answer
    (True, '{"name": "get_weather", "arguments": {"town": "Oslo"}}', False),
    (True, 'I will call: <tool_call>{"name": "get_time", "parameters"', False),     # its arguments' key
    (True, '<tool_call>\n{"name": "get_weather", "arguments": {"town": "Oslo"}}', False),   # its schema
])
def test_auto_lets_text_through_and_holds_a_started_call_to_the_tools(vocabulary, parallel, text, whole):
    tokenizer, ll_tokenizer, llguidance = vocabulary
    grammar = body(tools=[WEATHER, TIME], parallel_tool_calls=parallel).tool_plan().grammar().grammar
    matcher = llguidance.LLMatcher(ll_tokenizer, llguidance.grammar_from("lark", grammar), log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    accepted = matcher.consume_tokens(tokenizer.encode(text, add_special_tokens=False))
    assert (accepted and matcher.is_accepting()) == whole
    if whole and "\"name\": \"get_" in text:
        assert body(tools=[WEATHER, TIME]).tool_plan().calls(text)[1]   # what the grammar lets through parses


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


def reassemble(plan, pieces: list[str]) -> tuple[str | None, list[dict], str]:
    stream = ToolStream(plan)
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
    'Use it like this:\n```json\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n```',
    '  {"name": "get_weather", "arguments": {"city": "Rome"}}\n{"name": "get_time", "arguments": {"zone": "CET"}}',
    '{"a": 1} is JSON, and ```python\nx = 1\n``` is code.',
    'Here: [{"name": "get_weather", "arguments": {"city": "Rome"}}, {"name": "get_time", "arguments": {"zone": "CET"}}]',
])
def test_streamed_deltas_reassemble_into_the_whole_answer(text):
    plan = body(tools=[WEATHER, TIME]).tool_plan()
    whole_content, whole_calls = plan.calls(text)
    for size in (1, 3, 7, len(text)):
        content, calls, finish = reassemble(plan, [text[i:i + size] for i in range(0, len(text), size)])
        assert content == whole_content
        assert [(c["name"], c["arguments"]) for c in calls] == [(c.name, c.arguments) for c in whole_calls]
        assert finish == ("tool_calls" if whole_calls else "stop")


@pytest.mark.parametrize("text", [
    '{"name": "get_time", "parameters": {"zone": "CET"}}; {"name": "get_weather", "parameters": {"city": "Lima"}}',
    'Sure. {"name": "get_weather", "parameters": {"city": "Oslo"}}',
    '{"a": 1} is not a call',
])
def test_llama3_json_calls_stream_as_they_read_whole(text):
    plan = body(tools=[WEATHER, TIME]).tool_plan("llama3_json")
    whole_content, whole_calls = plan.calls(text)
    assert bool(whole_calls) == ("get_" in text)
    for size in (1, 4, len(text)):
        content, calls, _ = reassemble(plan, [text[i:i + size] for i in range(0, len(text), size)])
        assert content == whole_content and [c["name"] for c in calls] == [c.name for c in whole_calls]


def test_a_named_call_streams_its_arguments_as_they_come():
    plan = body(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}}).tool_plan()
    content, calls, finish = reassemble(plan, ['{"city"', ': "Oslo"', "}"])
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
