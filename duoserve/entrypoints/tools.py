"""Tool calls on /v1/chat/completions: what ``tool_choice`` asks the engine for, and the calls read back.

- ``none`` (or no tools): plain chat; the tools are not shown to the model.
- a named function: the output is that function's arguments, generated under its parameters'
  JSON schema (so they always parse and validate); one call, ``finish_reason`` ``stop`` (OpenAI's).
- ``required``: the output is a JSON list of ``{"name", "parameters"}`` objects, each under one
  tool's schema (one item when ``parallel_tool_calls`` is false); ``finish_reason`` ``tool_calls``.
- ``auto`` (the default with tools): the model answers freely with the tools in its chat template,
  and the server's ``--tool-call-parser`` reads the calls out of the text: ``hermes`` (Qwen2.5,
  Hermes: ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``), ``llama3_json`` (a bare
  ``{"name": ..., "parameters": ...}``), ``mistral`` (``[TOOL_CALLS] [{"name", "arguments"}]``).
  Text the parser does not recognise as a call stays content.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

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

    def grammar(self) -> StructuredOutputsParams | None:
        """The constraint a named or required choice puts on the output."""
        functions = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"} for t in self.tools}
        if self.mode == "named":
            return StructuredOutputsParams(json=functions[self.name], param="tool_choice")
        if self.mode != "required":
            return None
        calls = [{"type": "object", "properties": {"name": {"const": name}, "parameters": schema},
                  "required": ["name", "parameters"], "additionalProperties": False}
                 for name, schema in functions.items()]
        schema = {"type": "array", "items": calls[0] if len(calls) == 1 else {"anyOf": calls}, "minItems": 1}
        if not self.parallel:
            schema["maxItems"] = 1
        return StructuredOutputsParams(json=schema, param="tools")

    def calls(self, text: str, parser: str | None) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a finished output."""
        if self.mode == "named":
            return None, [ToolCall(self.name, text)]
        if self.mode == "required":
            try:
                items = json.loads(text)
            except json.JSONDecodeError:       # cut short by max_tokens: no call to give
                return text, []
            return None, [ToolCall(i["name"], json.dumps(i["parameters"], ensure_ascii=False)) for i in items]
        if self.mode == "auto" and parser is not None:
            content, calls = PARSERS[parser](text)
            return content, calls if self.parallel else calls[:1]
        return text, []


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def _call_of(document: str, arguments_key: str) -> ToolCall | None:
    try:
        item = json.loads(document)
    except json.JSONDecodeError:
        return None
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        return None
    arguments = item.get(arguments_key, item.get("arguments", {}))
    return ToolCall(item["name"], arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False))


def parse_hermes(text: str) -> tuple[str | None, list[ToolCall]]:
    start = text.find("<tool_call>")
    if start < 0:
        return text, []
    calls = [_call_of(m.group(1), "arguments") for m in _HERMES.finditer(text, start)]
    if not calls or None in calls:
        return text, []
    return text[:start].rstrip() or None, calls


def parse_llama3_json(text: str) -> tuple[str | None, list[ToolCall]]:
    stripped = text.strip().removeprefix("<|python_tag|>")
    calls = [_call_of(part, "parameters") for part in stripped.split(";")] if stripped.startswith("{") else []
    if not calls or None in calls:
        return text, []
    return None, calls


def parse_mistral(text: str) -> tuple[str | None, list[ToolCall]]:
    start = text.find("[TOOL_CALLS]")
    if start < 0:
        return text, []
    try:
        items = json.loads(text[start + len("[TOOL_CALLS]"):].strip())
    except json.JSONDecodeError:
        return text, []
    calls = [_call_of(json.dumps(i), "arguments") for i in (items if isinstance(items, list) else [items])]
    if not calls or None in calls:
        return text, []
    return text[:start].rstrip() or None, calls


PARSERS = {"hermes": parse_hermes, "llama3_json": parse_llama3_json, "mistral": parse_mistral}
TOOL_CALL_PARSERS = tuple(PARSERS)   # serve --tool-call-parser's choices
OPENING = {"hermes": "<tool_call>", "llama3_json": "{", "mistral": "[TOOL_CALLS]"}   # where calls begin


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
    then its arguments). In ``auto`` the content is held back while it could be the start of the
    parser's opening (and trailing whitespace before it), so the streamed content is the whole
    answer's content."""

    def __init__(self, plan: ToolPlan, parser: str | None) -> None:
        self.plan, self.parser = plan, parser
        self.text, self.sent = "", 0      # all text so far; how much of it went out as content
        self.in_calls = False             # auto: the parser's opening has been seen
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
        if mode != "auto" or self.parser is None:
            return self._content(len(self.text)) if delta else []
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

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if reason == "stop" and self.num_calls and self.plan.mode != "named" else reason

    def _opening(self) -> int | None:
        opening = OPENING[self.parser]
        if self.parser == "llama3_json":   # a bare JSON call: only when the answer begins with it
            stripped = self.text.lstrip().removeprefix("<|python_tag|>")
            return len(self.text) - len(stripped) if stripped.startswith("{") else None
        start = self.text.find(opening)
        return start if start >= 0 else None

    def _safe_end(self) -> int:
        """How far the text may go out as content: not a possible start of the opening, nor the
        whitespace before it."""
        opening, text = OPENING[self.parser], self.text
        if self.parser == "llama3_json" and not text.strip():
            return self.sent          # nothing but whitespace yet: the answer may still open with "{"
        end = len(text)
        for k in range(min(len(opening) - 1, len(text)), 0, -1):
            if text.endswith(opening[:k]):
                end = len(text) - k
                break
        return max(self.sent, len(text[:end].rstrip()))

    def _content(self, end: int) -> list[dict]:
        piece, self.sent = self.text[self.sent:end], max(self.sent, end)
        return [{"content": piece}] if piece else []

    def _calls(self, text: str) -> list[dict]:
        content, calls = self.plan.calls(text, self.parser)
        if not calls:                 # nothing parsed as a call: it is content after all
            return self._content(len(self.text))
        self.num_calls = len(calls)
        deltas = []
        for index, call in enumerate(calls):
            deltas.append({"tool_calls": [{"index": index, "id": call.id, "type": "function",
                                           "function": {"name": call.name, "arguments": ""}}]})
            deltas.append({"tool_calls": [{"index": index, "function": {"arguments": call.arguments}}]})
        return deltas
