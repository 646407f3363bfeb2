"""Anthropic's Messages API request (``POST /v1/messages``), translated at the edge into the one
chat request the engine path serves (``ChatCompletionRequest``).

What maps: ``system`` (a string or text blocks; a ``system`` message inside ``messages``, as Claude
Code style clients send it, joins it), ``messages`` of text, ``tool_use`` and
``tool_result`` blocks (an assistant's calls and the results sent back, as the chat template shows
them), a final assistant message (the answer goes on from it), ``max_tokens``, ``stop_sequences``,
``temperature`` (the API's default 1.0), ``top_p``, ``top_k`` (and vLLM's ``ignore_eos``), ``tools`` (``input_schema``) and
``tool_choice`` (``auto``, ``any``, ``tool``, ``none``, ``disable_parallel_tool_use``),
``output_config.format`` (a JSON schema, as ``response_format`` does), ``thinking`` (the server's
reasoning parser). Accepted and changing nothing: ``metadata``, ``service_tier``, ``cache_control``
(the prefix cache is always on), ``output_config.effort``, and ``thinking.budget_tokens`` (the
thinking stays within ``max_tokens``, as the API requires of the budget). Anything else is a 400
naming it: another content type (images, documents), a server tool, or a field this server does
not implement.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from duoserve.entrypoints.errors import APIError
from duoserve.entrypoints.protocol import ChatCompletionRequest

# fields accepted that change nothing here (see the module's docstring)
IGNORED_FIELDS = ("metadata", "service_tier", "cache_control")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="allow")

    def refuse_unknown(self, where: str, ignored: tuple[str, ...] = ()) -> None:
        for name in sorted(self.model_extra or {}):
            if name not in ignored:
                raise APIError(400, f"'{where}{name}' is not supported by this server", param=f"{where}{name}")


class ContentBlock(_Strict):
    """Any content block; which fields it needs depends on its type (checked in translation)."""
    type: str
    text: str | None = None
    id: str | None = None                      # tool_use
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None             # tool_result
    content: str | list[ContentBlock] | None = None
    is_error: bool | None = None
    thinking: str | None = None                # thinking (an earlier turn's: not shown to the model)
    signature: str | None = None
    data: str | None = None                    # redacted_thinking
    cache_control: dict[str, Any] | None = None
    citations: list[Any] | None = None


class Message(_Strict):
    role: Literal["user", "assistant", "system"]   # system: Claude Code style clients send it here too
    content: str | list[ContentBlock]


class Tool(_Strict):
    name: str = Field(min_length=1, max_length=128, pattern=r"^[a-zA-Z0-9_-]+$")
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: dict[str, Any] | None = None
    strict: bool | None = None                 # the schema is enforced whole whatever it says


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class OutputFormat(_Strict):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Strict):
    format: OutputFormat | None = None
    effort: str | None = None                  # how hard Claude thinks: no meaning for this server's model


class Thinking(_Strict):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None


class MessagesRequest(_Strict):
    model: str
    messages: list[Message] = Field(min_length=1)
    max_tokens: int = Field(ge=1)
    system: str | list[ContentBlock] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    tools: list[dict[str, Any]] | None = None  # checked one by one: a server tool is refused by name
    tool_choice: ToolChoice | None = None
    output_config: OutputConfig | None = None
    thinking: Thinking | None = None
    ignore_eos: bool = False                   # vLLM's extra (benchmark clients send it)
    priority: int = 0                          # duoserve's extra: lower first (--scheduling-policy priority)
    timeout: float | None = Field(default=None, gt=0)   # duoserve's extra: seconds to wait for its first step

    def _user_id(self) -> str | None:
        """``metadata.user_id``: who asked (the tenant, where API keys are shared)."""
        metadata = (self.model_extra or {}).get("metadata")
        user = metadata.get("user_id") if isinstance(metadata, dict) else None
        return user if isinstance(user, str) else None

    def to_chat(self, reasoning_parser: str | None, for_counting: bool = False) -> ChatCompletionRequest:
        """The same request as a chat completion (``for_counting``: count_tokens', no sampling)."""
        self.refuse_unknown("", IGNORED_FIELDS)
        if self.output_config is not None:
            self.output_config.refuse_unknown("output_config.")
        tools = [_tool(i, t) for i, t in enumerate(self.tools or ())]
        body: dict[str, Any] = {"model": self.model, "messages": self._messages(), "stream": self.stream,
                                "max_tokens": None if for_counting else self.max_tokens,
                                "temperature": 1.0 if self.temperature is None else self.temperature,
                                "top_p": self.top_p, "top_k": self.top_k, "stop": self.stop_sequences,
                                "include_stop_str_in_output": False, "ignore_eos": self.ignore_eos,
                                "priority": self.priority, "timeout": self.timeout, "user": self._user_id()}
        if tools:
            body["tools"] = tools
            body.update(self._tool_choice())
        if self.output_config is not None and self.output_config.format is not None:
            body["response_format"] = {"type": "json_schema", "json_schema": {
                "name": "output", "schema": self.output_config.format.schema_}}
        body["continue_final_message"] = self.messages[-1].role == "assistant"
        thinking = self._thinking(reasoning_parser)
        if thinking is not None:
            body["chat_template_kwargs"] = thinking
        return ChatCompletionRequest.of_translated(body)

    def _messages(self) -> list[dict]:
        out: list[dict] = []
        # the system prompt: ``system`` and any system message (merged in order, as one prompt)
        system = [_text_of(self.system, "system")] if self.system else []
        system += [_text_of(m.content, f"messages.{i}.content")
                   for i, m in enumerate(self.messages) if m.role == "system"]
        if any(system):
            out.append({"role": "system", "content": "\n\n".join(text for text in system if text)})
        for i, message in enumerate(self.messages):
            where = f"messages.{i}.content"
            if message.role == "system":
                continue
            if isinstance(message.content, str):
                out.append({"role": message.role, "content": message.content})
            elif message.role == "user":
                out += _user_turn(message.content, where)
            else:
                out.append(_assistant_turn(message.content, where))
        return out

    def _tool_choice(self) -> dict:
        choice = self.tool_choice
        if choice is None:
            return {}
        if choice.type == "tool":
            if not choice.name:
                raise APIError(400, "tool_choice of type 'tool' needs the tool's 'name'", param="tool_choice.name")
            mapped: Any = {"type": "function", "function": {"name": choice.name}}
        else:
            mapped = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
        return {"tool_choice": mapped, "parallel_tool_calls": not choice.disable_parallel_tool_use}

    def _thinking(self, reasoning_parser: str | None) -> dict | None:
        """The chat template's variables that thinking asks for."""
        if self.thinking is None:
            return None
        if self.thinking.type == "disabled":
            return {"enable_thinking": False} if reasoning_parser else None
        if reasoning_parser is None:
            raise APIError(400, f"thinking of type '{self.thinking.type}' needs a reasoning model: start the "
                           "server with --reasoning-parser (deepseek_r1, qwen3), or leave thinking out",
                           param="thinking")
        return {"enable_thinking": True}


class CountTokensRequest(MessagesRequest):
    """/v1/messages/count_tokens: a message request without max_tokens."""
    max_tokens: int | None = None


def _text_of(content: str | list[ContentBlock], where: str) -> str:
    if isinstance(content, str):
        return content
    for k, block in enumerate(content):
        if block.type != "text":
            raise APIError(400, f"content block type '{block.type}' is not supported here: only 'text'",
                           param=f"{where}.{k}.type")
    return "".join(block.text or "" for block in content)


def _user_turn(blocks: list[ContentBlock], where: str) -> list[dict]:
    """A user message's blocks: tool results as tool messages, the text between them as user
    messages, in their order."""
    out: list[dict] = []
    text: list[str] = []
    for k, block in enumerate(blocks):
        if block.type == "text":
            text.append(block.text or "")
        elif block.type == "tool_result":
            if text:
                out.append({"role": "user", "content": "".join(text)})
                text = []
            result = _text_of(block.content or "", f"{where}.{k}.content")
            if block.is_error:
                result = f"Error: {result}"
            out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": result})
        else:
            raise APIError(400, f"content block type '{block.type}' is not supported in a user message: this "
                           "model reads 'text' and 'tool_result' blocks", param=f"{where}.{k}.type")
    if text or not out:
        out.append({"role": "user", "content": "".join(text)})
    return out


def _assistant_turn(blocks: list[ContentBlock], where: str) -> dict:
    """An assistant message's blocks: its text, and its tool_use blocks as calls (thinking of an
    earlier turn is not shown to the model, as chat templates drop it)."""
    text: list[str] = []
    calls: list[dict] = []
    for k, block in enumerate(blocks):
        if block.type == "text":
            text.append(block.text or "")
        elif block.type == "tool_use":
            if not block.id or not block.name:
                raise APIError(400, "a tool_use block needs its 'id' and 'name'", param=f"{where}.{k}")
            calls.append({"id": block.id, "type": "function",
                          "function": {"name": block.name, "arguments": json.dumps(block.input or {})}})
        elif block.type not in ("thinking", "redacted_thinking"):
            raise APIError(400, f"content block type '{block.type}' is not supported in an assistant message",
                           param=f"{where}.{k}.type")
    message: dict = {"role": "assistant", "content": "".join(text) or None}
    if calls:
        message["tool_calls"] = calls
    return message


def _tool(index: int, raw: dict[str, Any]) -> dict:
    if raw.get("type") not in (None, "custom"):
        raise APIError(400, f"tool type '{raw['type']}' (a tool Anthropic's servers run) is not supported: "
                       "give custom tools with an input_schema", param=f"tools.{index}.type")
    try:
        tool = Tool.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in ("tools", index, *first.get("loc", ())))
        raise APIError(400, f"invalid value for {where}: {first.get('msg')}", param=where) from exc
    tool.refuse_unknown(f"tools.{index}.", ("cache_control",))
    function = {"name": tool.name, "parameters": tool.input_schema}
    if tool.description:
        function["description"] = tool.description
    return {"type": "function", "function": function}
