"""Tool calls on /v1/chat/completions: what ``tool_choice`` asks the engine for, and the calls read back.

- ``none`` (or no tools): plain chat; the tools are not shown to the model.
- a named function: the output is that function's arguments, generated under its parameters'
  JSON schema (so they always parse and validate); one call, ``finish_reason`` ``stop`` (OpenAI's).
- ``required``: the output is a JSON list of ``{"name", "parameters"}`` objects, each under one
  tool's schema (one item when ``parallel_tool_calls`` is false); ``finish_reason`` ``tool_calls``.
- ``auto`` (the default with tools): the model answers freely with the tools in its chat template
  (or the generic format's system prompt: ``tool_formats``), and once it starts a call the rest is
  held to the tools' grammar; the calls are read out of the text by the model's parser (found from
  its template, or ``--tool-call-parser``): ``hermes`` (``<tool_call>{"name": ..., "arguments": ...}
  </tool_call>``, and the same JSON fenced or bare), ``llama3_json`` (a bare ``{"name": ...,
  "parameters": ...}``), ``mistral`` (``[TOOL_CALLS] [{"name", "arguments"}]``). Text the parser
  does not recognise as a call stays content.
"""

from __future__ import annotations

import functools
import json
import uuid
from dataclasses import dataclass, field

import regex

from duoserve.entrypoints.tool_formats import (GENERIC, HERMES, LLAMA3_JSON, MISTRAL, auto_call_grammar,
                                               generic_schema, trigger)
from duoserve.sampling_params import StructuredOutputsParams

@dataclass
class ToolCall:
    name: str
    arguments: str                       # a JSON document, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def as_dict(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ToolPlan:
    """How one chat request uses its tools."""
    mode: str                            # none, named, required, auto
    tools: list[dict]                    # the definitions the chat template sees ([] for none)
    name: str | None = None              # named: the function
    parallel: bool = True
    parser: str = HERMES                 # auto: how the model writes its calls
    lazy: bool = True                    # auto: a started call is held to the tools' grammar

    def grammar(self) -> StructuredOutputsParams | None:
        """The constraint the choice puts on the output: a named or required call's from the first
        token, ``auto``'s once a call starts (Mistral's calls open with a special token: read, not held)."""
        functions = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"} for t in self.tools}
        if self.mode == "named":
            return StructuredOutputsParams(json=functions[self.name], param="tool_choice")
        if self.mode == "auto":
            if not self.lazy or self.parser == MISTRAL:
                return None
            if self.parser == GENERIC:
                return StructuredOutputsParams(json=generic_schema(self.tools, self.parallel), param="tools")
            llama3 = self.parser == LLAMA3_JSON
            return StructuredOutputsParams(grammar=auto_call_grammar(
                self.tools, self.parallel, "parameters" if llama3 else "arguments", tags=not llama3), param="tools")
        if self.mode != "required":
            return None
        calls = [{"type": "object", "properties": {"name": {"const": name}, "parameters": schema},
                  "required": ["name", "parameters"], "additionalProperties": False}
                 for name, schema in functions.items()]
        schema = {"type": "array", "items": calls[0] if len(calls) == 1 else {"anyOf": calls}, "minItems": 1}
        if not self.parallel:
            schema["maxItems"] = 1
        return StructuredOutputsParams(json=schema, param="tools")

    def calls(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a finished output."""
        if self.mode == "named":
            return None, [ToolCall(self.name, text)]
        if self.mode == "required":
            try:
                items = json.loads(text)
            except json.JSONDecodeError:       # cut short by max_tokens: no call to give
                return text, []
            return None, [ToolCall(i["name"], json.dumps(i["parameters"], ensure_ascii=False)) for i in items]
        if self.mode == "auto":
            if self.parser in (HERMES, LLAMA3_JSON):
                content, calls = (parse_hermes if self.parser == HERMES else parse_llama3_json)(text, self.names)
            else:
                content, calls = (parse_generic if self.parser == GENERIC else parse_mistral)(text)
            return content, calls if self.parallel else calls[:1]
        return text, []

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(t["function"]["name"] for t in self.tools)


_DECODER = json.JSONDecoder()


@functools.lru_cache(maxsize=256)
def _trigger(names: tuple[str, ...], tags: bool = True) -> regex.Pattern:
    return regex.compile(trigger(list(names), tags))


def _call_of(item, arguments_key: str) -> ToolCall | None:
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        return None
    arguments = item.get(arguments_key, item.get("arguments", item.get("parameters", {})))
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return ToolCall(item["name"], text)


def call_start(text: str, names: tuple[str, ...], tags: bool = True) -> int | None:
    """Where the first call starts in ``text`` (its trigger: ``tool_formats.trigger``)."""
    found = _trigger(names, tags).search(text)
    return found.start() if found else None


def _scan_calls(text: str, start: int, arguments_key: str) -> list[ToolCall] | None:
    """The calls from ``start`` to the end, each tagged, fenced or bare, alone or listed; None
    when one does not parse (cut short by max_tokens, or not a call after all)."""
    calls, at = [], start
    while True:
        while at < len(text) and text[at] in " \t\r\n,[]":
            at += 1
        for mark in ("<tool_call>", "</tool_call>", "```json", "```"):
            if text.startswith(mark, at):
                at += len(mark)
                break
        else:
            if at == len(text) or text[at] != "{":
                return calls or None   # text after the calls: nothing the grammar lets through
            try:
                item, at = _DECODER.raw_decode(text, at)
            except json.JSONDecodeError:
                return None
            call = _call_of(item, arguments_key)
            if call is None:
                return None
            calls.append(call)


def parse_hermes(text: str, names: tuple[str, ...] = ()) -> tuple[str | None, list[ToolCall]]:
    """Hermes' tagged calls, the same JSON fenced, or JSON naming one of the tools (``names``)."""
    return _parse_json_calls(text, names, "arguments", tags=True)


def parse_llama3_json(text: str, names: tuple[str, ...] = ()) -> tuple[str | None, list[ToolCall]]:
    """Llama 3's calls: bare JSON with ``parameters`` (after ``<|python_tag|>``, ``;`` between
    calls), opening the answer or naming one of the tools."""
    stripped = text.strip().removeprefix("<|python_tag|>").replace("};", "}\n")
    if stripped.startswith("{"):
        calls = _scan_calls(stripped, 0, "parameters")
        return (None, calls) if calls else (text, [])
    return _parse_json_calls(text, names, "parameters", tags=False)


def _parse_json_calls(text: str, names: tuple[str, ...], arguments_key: str,
                      tags: bool) -> tuple[str | None, list[ToolCall]]:
    start = call_start(text, names, tags)
    calls = _scan_calls(text, start, arguments_key) if start is not None else None
    if not calls:
        return text, []
    return text[:start].rstrip() or None, calls


def parse_mistral(text: str) -> tuple[str | None, list[ToolCall]]:
    start = text.find("[TOOL_CALLS]")
    if start < 0:
        return text, []
    try:
        items = json.loads(text[start + len("[TOOL_CALLS]"):].strip())
    except json.JSONDecodeError:
        return text, []
    calls = [_call_of(i, "arguments") for i in (items if isinstance(items, list) else [items])]
    if not calls or None in calls:
        return text, []
    return text[:start].rstrip() or None, calls


_RESPONSE_OPENING = regex.compile(r'\s*\{\s*"response"\s*:\s*"')


def string_prefix(body: str) -> tuple[str, bool]:
    """(the text of a JSON string's body so far, whether it closed): an escape not yet whole, or
    the first half of a surrogate pair, waits for the rest."""
    i = 0
    while i < len(body):
        if body[i] == '"':
            return json.loads(f'"{body[:i]}"'), True
        if body[i] == "\\":
            step = 6 if body[i + 1:i + 2] == "u" else 2
            if i + step > len(body):
                break
            i += step
        else:
            i += 1
    text = json.loads(f'"{body[:i]}"')
    return (text[:-1] if text and "\ud800" <= text[-1] <= "\udbff" else text), False


def parse_generic(text: str) -> tuple[str | None, list[ToolCall]]:
    """The generic format's JSON answer: its calls, or its response (so far, when cut short by
    max_tokens); other text is content as it is."""
    try:
        answer = json.loads(text)
    except json.JSONDecodeError:
        opening = _RESPONSE_OPENING.match(text)
        if opening is None:
            return text, []
        try:
            return string_prefix(text[opening.end():])[0], []
        except json.JSONDecodeError:
            return text, []
    if isinstance(answer, dict) and isinstance(answer.get("response"), str) and len(answer) == 1:
        return answer["response"], []
    items = answer.get("tool_calls") if isinstance(answer, dict) else None
    calls = [_call_of(i, "arguments") for i in items] if isinstance(items, list) and items else [None]
    return (text, []) if None in calls else (None, calls)


def for_template(messages: list[dict]) -> list[dict]:
    """Assistant tool calls with their arguments as objects, as chat templates expect (they
    ``tojson`` them); OpenAI sends them as JSON text."""
    out = []
    for message in messages:
        calls = message.get("tool_calls")
        if calls:
            message = {**message, "tool_calls": [
                {**c, "function": {**c["function"], "arguments": _loaded(c["function"].get("arguments"))}}
                for c in calls]}
        out.append(message)
    return out


def _loaded(arguments):
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return arguments


class ToolStream:
    """One streamed choice under a tool plan: the deltas to send for each new piece of text.
    A named call streams its arguments as they come (its name first); a required list, or calls
    an ``auto`` parser finds, go out whole when the output ends (each call's index, id and name,
    then its arguments). In ``auto`` the content is held back while it could be the start of a
    call (and trailing whitespace before it), so the streamed content is the whole answer's content."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.text, self.sent = "", 0      # all text so far; how much of it went out as content
        self.in_calls = False             # auto: a call has started
        self.named_call: ToolCall | None = None
        self.num_calls = 0

    def feed(self, delta: str, finished: bool) -> list[dict]:
        mode = self.plan.mode
        if mode == "named":
            deltas = []
            if self.named_call is None:
                self.named_call = ToolCall(self.plan.name, "")
                deltas.append({"tool_calls": [{"index": 0, "id": self.named_call.id, "type": "function",
                                               "function": {"name": self.plan.name, "arguments": ""}}]})
                self.num_calls = 1
            if delta:
                deltas.append({"tool_calls": [{"index": 0, "function": {"arguments": delta}}]})
            return deltas
        self.text += delta
        if mode == "required":
            return self._calls(self.text) if finished else []
        if mode != "auto":
            return self._content(len(self.text)) if delta else []
        if self.plan.parser == GENERIC:
            return self._generic(finished)
        if not self.in_calls:
            start = self._opening()
            if start is not None:
                self.in_calls = True
                content = self._content(len(self.text[:start].rstrip()))
                return content + (self._calls(self.text) if finished else [])
            if finished:
                return self._content(len(self.text))
            return self._content(self._safe_end())
        return self._calls(self.text) if finished else []

    def _generic(self, finished: bool) -> list[dict]:
        """The generic format: a response's text goes out as it comes, calls when the answer ends."""
        if finished:
            content, calls = self.plan.calls(self.text)
            if calls:
                return self._calls(self.text)
            piece = (content or "")[self.sent:]
            self.sent += len(piece)
            return [{"content": piece}] if piece else []
        opening = _RESPONSE_OPENING.match(self.text)
        if opening is None:
            return []
        try:
            so_far = string_prefix(self.text[opening.end():])[0]
        except json.JSONDecodeError:
            return []
        piece, self.sent = so_far[self.sent:], max(self.sent, len(so_far))
        return [{"content": piece}] if piece else []

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if reason == "stop" and self.num_calls and self.plan.mode != "named" else reason

    def _opening(self) -> int | None:
        parser, text = self.plan.parser, self.text
        if parser == MISTRAL:
            start = text.find("[TOOL_CALLS]")
            return start if start >= 0 else None
        if parser == LLAMA3_JSON:   # a bare JSON call opening the answer, or one naming a tool
            stripped = text.lstrip().removeprefix("<|python_tag|>")
            if stripped.startswith("{"):
                return len(text) - len(stripped)
        return call_start(text, self.plan.names, tags=parser == HERMES)

    def _safe_end(self) -> int:
        """How far the text may go out as content: not a possible start of a call, nor the
        whitespace before it."""
        text, parser = self.text, self.plan.parser
        if parser == LLAMA3_JSON and not text.strip():
            return self.sent          # the answer may still open with a bare call
        end = len(text)
        if parser == MISTRAL:
            for k in range(min(len("[TOOL_CALLS]") - 1, len(text)), 0, -1):
                if text.endswith("[TOOL_CALLS]"[:k]):
                    end = len(text) - k
                    break
        else:
            pattern = _trigger(self.plan.names, parser == HERMES)
            for at in range(self.sent, len(text)):
                if pattern.match(text, at, partial=True):
                    end = at
                    break
        return max(self.sent, len(text[:end].rstrip()))

    def _content(self, end: int) -> list[dict]:
        piece, self.sent = self.text[self.sent:end], max(self.sent, end)
        return [{"content": piece}] if piece else []

    def _calls(self, text: str) -> list[dict]:
        content, calls = self.plan.calls(text)
        if not calls:                 # nothing parsed as a call: it is content after all
            return self._content(len(self.text))
        self.num_calls = len(calls)
        deltas = []
        for index, call in enumerate(calls):
            deltas.append({"tool_calls": [{"index": index, "id": call.id, "type": "function",
                                           "function": {"name": call.name, "arguments": ""}}]})
            deltas.append({"tool_calls": [{"index": index, "function": {"arguments": call.arguments}}]})
        return deltas
