"""OpenAI's Responses API request (``POST /v1/responses``), translated at the edge into the one
chat request the engine path serves (``ChatCompletionRequest``).

What maps: ``input`` (a string, or items: messages with text parts, ``function_call`` and
``function_call_output`` items, a ``compaction`` item from ``/v1/responses/compact``; ``reasoning``
items of an earlier turn are not shown to the model), ``instructions`` (a system message first),
``previous_response_id`` (the earlier response's conversation first: ``responses_store``),
``tools`` of type ``function`` and ``tool_choice``, ``text.format`` (``text``, ``json_object``,
``json_schema``), ``max_output_tokens``, ``max_tool_calls``, ``temperature``, ``top_p``,
``presence_penalty``, ``frequency_penalty``, ``top_logprobs`` with ``include:
["message.output_text.logprobs"]`` (and vLLM's ``top_k``, ``seed``, ``ignore_eos``),
``parallel_tool_calls``, ``reasoning`` (``effort: "none"`` turns a reasoning model's thinking off;
without ``--reasoning-parser`` the effort changes nothing), ``store`` and ``background``. Echoed
and changing nothing: ``metadata``, ``user``, ``safety_identifier``, ``service_tier``,
``prompt_cache_key``, ``prompt_cache_retention`` (the prefix cache is always on),
``stream_options``, an assistant message's ``phase``. ``truncation: "auto"`` drops the
conversation's oldest items while the prompt does not fit the context. Any other field,
or another value of these, is a 400 naming it.
"""

from __future__ import annotations

import base64
import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from duoserve.entrypoints.errors import APIError
from duoserve.entrypoints.protocol import ChatCompletionRequest

ECHOED_FIELDS = ("metadata", "user", "safety_identifier", "service_tier", "prompt_cache_key",
                 "prompt_cache_retention", "stream_options")
LOGPROBS_INCLUDE = "message.output_text.logprobs"
# fields of features this server lacks: refused unless they ask for nothing
_REFUSED_UNLESS = {"conversation": (None,), "prompt": (None,)}
_TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")
COMPACTION_PREFIX = "duoserve.v1."   # what a compaction item's content starts with (its items, base64 JSON)


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    input: str | list[dict[str, Any]] = ""
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool | None = None
    background: bool | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_tool_calls: int | None = Field(default=None, ge=1)
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    truncation: Literal["auto", "disabled"] | None = None
    top_k: int | None = None      # vLLM's extras
    seed: int | None = None
    ignore_eos: bool = False
    priority: int = 0             # lower first under --scheduling-policy priority or fair
    timeout: float | None = Field(default=None, gt=0)   # seconds it may wait for its first step
    stream: bool = False

    def user(self) -> str | None:
        """Who asked (the tenant, where API keys are shared): ``user``, or its successor
        ``safety_identifier``."""
        extra = self.model_extra or {}
        user = extra.get("user") or extra.get("safety_identifier")
        return user if isinstance(user, str) else None

    def check(self) -> None:
        """Refuse by name what this server does not implement."""
        for name, value in sorted((self.model_extra or {}).items()):
            if name in _REFUSED_UNLESS and value in _REFUSED_UNLESS[name]:
                continue
            if name in _REFUSED_UNLESS:
                raise APIError(400, f"'{name}' is not supported by this server: leave it out", param=name)
            if name not in ECHOED_FIELDS:
                raise APIError(400, f"'{name}' is not supported by this server", param=name)
        for k, item in enumerate(self.include or ()):
            if item != LOGPROBS_INCLUDE:
                raise APIError(400, f"include value {item!r} is not supported: only {LOGPROBS_INCLUDE!r}",
                               param=f"include.{k}")
        if self.background and self.store is False:
            raise APIError(400, "background responses are stored: leave out store, or send store: true",
                           param="background")
        if self.background and self.stream:
            raise APIError(400, "a background response is polled (GET /v1/responses/{id}), not streamed: leave "
                           "out stream", param="background")

    def items(self) -> list[dict]:
        """The input as a list of items (a string is one user message)."""
        if isinstance(self.input, str):
            return [{"type": "message", "role": "user", "content": self.input}] if self.input else []
        return list(self.input)

    def to_chat(self, history: list[dict], reasoning_parser: str | None, drop: int = 0) -> ChatCompletionRequest:
        """The chat request of this turn: ``history`` (the items of the response it follows, its
        output included) before its own input, less the ``drop`` oldest items (``truncation``);
        ``check`` has refused what this server does not implement."""
        logprobs = LOGPROBS_INCLUDE in (self.include or ())
        messages = messages_of(history, self.items(), self.instructions, drop)
        body: dict[str, Any] = {"model": self.model, "messages": messages,
                                "stream": self.stream, "max_tokens": self.max_output_tokens,
                                "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                                "presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty,
                                "seed": self.seed, "ignore_eos": self.ignore_eos, "logprobs": logprobs,
                                "priority": self.priority, "timeout": self.timeout, "user": self.user(),
                                "top_logprobs": self.top_logprobs if logprobs else None}
        if self.tools:
            body["tools"] = [_tool(i, t) for i, t in enumerate(self.tools)]
        if self.tool_choice is not None:
            body["tool_choice"] = _tool_choice(self.tool_choice)
        if self.parallel_tool_calls is not None or self.max_tool_calls == 1:
            body["parallel_tool_calls"] = self.parallel_tool_calls is not False and self.max_tool_calls != 1
        response_format = self._format()
        if response_format is not None:
            body["response_format"] = response_format
        effort = (self.reasoning or {}).get("effort")
        if reasoning_parser and effort == "none":
            body["chat_template_kwargs"] = {"enable_thinking": False}
        return ChatCompletionRequest.of_translated(body)

    def _format(self) -> dict | None:
        fmt = (self.text or {}).get("format")
        if fmt is None or fmt.get("type") == "text":
            return None
        if fmt.get("type") == "json_object":
            return {"type": "json_object"}
        if fmt.get("type") == "json_schema":
            return {"type": "json_schema", "json_schema": {"name": fmt.get("name") or "output",
                                                           "schema": fmt.get("schema"), "strict": fmt.get("strict")}}
        raise APIError(400, f"text.format type {fmt.get('type')!r} is not supported: text, json_object or "
                       "json_schema", param="text.format.type")


def messages_of(history: list[dict], items: list[dict], instructions: str | None, drop: int = 0) -> list[dict]:
    """The chat messages of a conversation's items, less the ``drop`` oldest (and the outputs of
    calls dropped with them); ``instructions`` first (they are not carried over from an earlier
    response)."""
    out: list[dict] = [{"role": "system", "content": instructions}] if instructions else []
    calls: set[str] = set()
    dropped: set[str] = set()
    for where, group in (("previous_response_id", history), ("input", items)):
        for i, item in enumerate(expand_compactions(group, where)):
            if drop > 0:
                drop -= 1
                dropped.add(item.get("call_id") or item.get("id"))
            elif not (item.get("type") == "function_call_output" and item.get("call_id") in dropped):
                _append(out, item, f"{where}.{i}" if where == "input" else where, calls)
    return out


def conversation_length(history: list[dict], items: list[dict]) -> int:
    """How many items ``drop`` may count (compactions unfolded)."""
    return len(expand_compactions(history, "previous_response_id")) + len(expand_compactions(items, "input"))


def _append(out: list[dict], item: dict, where: str, calls: set[str]) -> None:
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in ("user", "system", "developer", "assistant"):
            raise APIError(400, f"a message's role must be user, system, developer or assistant, not {role!r}",
                           param=f"{where}.role")
        out.append({"role": role, "content": _text(item.get("content"), f"{where}.content")})
    elif kind == "function_call":
        call_id = item.get("call_id") or item.get("id")
        calls.add(call_id)
        call = {"id": call_id, "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}}
        last = out[-1] if out else None
        if last is not None and last["role"] == "assistant":
            last.setdefault("tool_calls", []).append(call)   # the calls of one turn, together
        else:
            out.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "function_call_output":
        if item.get("call_id") not in calls:
            raise APIError(400, f"a function_call_output answers a function_call, and none in the input or the "
                           f"previous response before it has call_id {item.get('call_id')!r}", param=f"{where}.call_id")
        output = item.get("output")
        out.append({"role": "tool", "tool_call_id": item.get("call_id"),
                    "content": output if isinstance(output, str) else _text(output, f"{where}.output")})
    elif kind == "item_reference":
        raise APIError(400, "item_reference is not supported: send the item itself, or previous_response_id",
                       param=f"{where}.type")
    elif kind != "reasoning":
        raise APIError(400, f"input item type '{kind}' is not supported: give messages, function_call, "
                       "function_call_output and compaction items", param=f"{where}.type")


def compaction_of(items: list[dict]) -> str:
    """The opaque content of a compaction item: the items themselves (nothing is summarised)."""
    return COMPACTION_PREFIX + base64.urlsafe_b64encode(json.dumps(items, ensure_ascii=False).encode()).decode()


def expand_compactions(items: list[dict], where: str) -> list[dict]:
    """Items with each compaction item replaced by the items it holds."""
    out: list[dict] = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise APIError(400, "an input item must be an object", param=f"{where}.{i}")
        if item.get("type") != "compaction":
            out.append(item)
            continue
        content = item.get("encrypted_content") or ""
        try:
            held = json.loads(base64.urlsafe_b64decode(content.removeprefix(COMPACTION_PREFIX)))
        except ValueError:
            held = None
        if not content.startswith(COMPACTION_PREFIX) or not isinstance(held, list):
            raise APIError(400, "this compaction item was not made by this server's /v1/responses/compact",
                           param=f"{where}.{i}.encrypted_content")
        out += held
    return out


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, "content must be a string or a list of text parts", param=where)
    for k, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise APIError(400, f"content part type '{kind}' is not supported: this model reads text parts",
                           param=f"{where}.{k}.type")
    return "".join(part.get("text") or "" for part in content)


def _tool(index: int, tool: dict[str, Any]) -> dict:
    if tool.get("type") != "function":
        raise APIError(400, f"tool type {tool.get('type')!r} is not supported: only 'function' tools",
                       param=f"tools.{index}.type")
    function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
    return {"type": "function", "function": function}


def _tool_choice(choice: str | dict[str, Any]) -> Any:
    if isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and choice.get("name"):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise APIError(400, f"tool_choice {choice!r} is not supported: 'none', 'auto', 'required' or "
                   "{'type': 'function', 'name': ...}", param="tool_choice")


def tool_echo(tool: dict[str, Any]) -> dict:
    """A function tool as the response object shows it (every field, null when not given)."""
    return {"type": "function", "name": tool.get("name"), "description": tool.get("description"),
            "parameters": tool.get("parameters"), "strict": tool.get("strict")}
