"""OpenAI's Responses API request (``POST /v1/responses``), translated at the edge into the one
chat request the engine path serves (``ChatCompletionRequest``). Stateless: nothing is stored, so
``previous_response_id``, ``store: true``, ``conversation`` and ``background`` are refused by name.

What maps: ``input`` (a string, or items: messages with text parts, ``function_call`` and
``function_call_output`` items; ``reasoning`` items of an earlier turn are not shown to the model),
``instructions`` (a system message first), ``tools`` of type ``function`` and ``tool_choice``,
``text.format`` (``text``, ``json_object``, ``json_schema``), ``max_output_tokens``,
``temperature``, ``top_p`` (and vLLM's ``top_k``, ``seed``, ``ignore_eos``), ``parallel_tool_calls``, ``reasoning`` (``effort: "none"`` turns a
reasoning model's thinking off; without ``--reasoning-parser`` the effort changes nothing). Accepted
and changing nothing: ``metadata``, ``user``, ``safety_identifier``, ``service_tier``,
``prompt_cache_key``, ``prompt_cache_retention`` (the prefix cache is always on), ``stream_options``,
``truncation: "disabled"``. Any other field is a 400 naming it.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from duoserve.entrypoints.errors import APIError
from duoserve.entrypoints.protocol import ChatCompletionRequest

IGNORED_FIELDS = ("metadata", "user", "safety_identifier", "service_tier", "prompt_cache_key",
                  "prompt_cache_retention", "stream_options")
# fields that would need stored state or a feature this server lacks: refused unless they ask for nothing
_REFUSED_UNLESS = {"previous_response_id": (None,), "store": (None, False), "background": (None, False),
                   "conversation": (None,), "prompt": (None,), "include": (None, []), "max_tool_calls": (None,),
                   "top_logprobs": (None, 0), "truncation": (None, "disabled")}
_TEXT_PARTS = ("input_text", "output_text", "text")


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None      # vLLM's extras
    seed: int | None = None
    ignore_eos: bool = False
    stream: bool = False

    def to_chat(self, reasoning_parser: str | None) -> ChatCompletionRequest:
        self._refuse_fields()
        body: dict[str, Any] = {"model": self.model, "messages": self._messages(), "stream": self.stream,
                                "max_tokens": self.max_output_tokens, "temperature": self.temperature,
                                "top_p": self.top_p, "top_k": self.top_k, "seed": self.seed,
                                "ignore_eos": self.ignore_eos}
        if self.tools:
            body["tools"] = [_tool(i, t) for i, t in enumerate(self.tools)]
        if self.tool_choice is not None:
            body["tool_choice"] = _tool_choice(self.tool_choice)
        if self.parallel_tool_calls is not None:
            body["parallel_tool_calls"] = self.parallel_tool_calls
        response_format = self._format()
        if response_format is not None:
            body["response_format"] = response_format
        effort = (self.reasoning or {}).get("effort")
        if reasoning_parser and effort == "none":
            body["chat_template_kwargs"] = {"enable_thinking": False}
        return ChatCompletionRequest.of_translated(body)

    def _refuse_fields(self) -> None:
        for name, value in sorted((self.model_extra or {}).items()):
            if name in _REFUSED_UNLESS and value in _REFUSED_UNLESS[name]:
                continue
            if name in _REFUSED_UNLESS:
                raise APIError(400, f"'{name}' is not supported: this server is stateless and does not "
                               f"implement it; leave it out", param=name)
            if name not in IGNORED_FIELDS:
                raise APIError(400, f"'{name}' is not supported by this server", param=name)

    def _messages(self) -> list[dict]:
        out: list[dict] = [{"role": "system", "content": self.instructions}] if self.instructions else []
        if isinstance(self.input, str):
            return out + [{"role": "user", "content": self.input}]
        for i, item in enumerate(self.input):
            kind = item.get("type", "message")
            if kind == "message":
                role = item.get("role")
                if role not in ("user", "system", "developer", "assistant"):
                    raise APIError(400, f"a message's role must be user, system, developer or assistant, not "
                                   f"{role!r}", param=f"input.{i}.role")
                out.append({"role": role, "content": _text(item.get("content"), f"input.{i}.content")})
            elif kind == "function_call":
                call = {"id": item.get("call_id") or item.get("id"), "type": "function",
                        "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}}
                last = out[-1] if out else None
                if last is not None and last["role"] == "assistant":   # calls of one turn, together
                    last.setdefault("tool_calls", []).append(call)
                else:
                    out.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif kind == "function_call_output":
                output = item.get("output")
                out.append({"role": "tool", "tool_call_id": item.get("call_id"),
                            "content": output if isinstance(output, str) else _text(output, f"input.{i}.output")})
            elif kind != "reasoning":
                raise APIError(400, f"input item type '{kind}' is not supported: give messages, function_call "
                               "and function_call_output items", param=f"input.{i}.type")
        return out

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

