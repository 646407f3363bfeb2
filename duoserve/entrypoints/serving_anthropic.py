"""/v1/messages and /v1/messages/count_tokens: Anthropic's Messages API over the chat path.

The request becomes a chat request (``anthropic_protocol``), runs through ``ChatServing`` like
any chat, and its answer is rendered as Anthropic's message: ``thinking``, ``text`` and
``tool_use`` content blocks, ``stop_reason`` (``end_turn``, ``max_tokens``, ``stop_sequence``,
``tool_use``) and ``usage`` (``input_tokens`` not counting the prompt's prefix-cache hits, which
are ``cache_read_input_tokens``). A stream is Anthropic's named events: ``message_start``, per
block ``content_block_start`` / ``content_block_delta`` (``text_delta``, ``thinking_delta``,
``input_json_delta``) / ``content_block_stop``, then ``message_delta`` and ``message_stop``.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from duoserve.entrypoints.anthropic_protocol import MessagesRequest
from duoserve.entrypoints.blocks import Block, BlockKind, BlockStream
from duoserve.entrypoints.errors import APIError, anthropic_error_body
from duoserve.entrypoints.streams import Streams, run_until_disconnect
from duoserve.entrypoints.serving_chat import ChatAnswer, ChatServing
from duoserve.entrypoints.tools import ToolPlan


ENDED_EARLY = ("error", "abort")   # finish reasons with no answer to render


def event(name: str, data: dict) -> str:
    return f"event: {name}\ndata: {json.dumps(data)}\n\n"


def stop_reason(finish_reason: str | None, stop: int | str | None, stop_sequences: list[str] | None,
                has_calls: bool) -> tuple[str | None, str | None]:
    """(stop_reason, stop_sequence) of an answer that ended for ``finish_reason``."""
    if finish_reason in ("stop", "tool_calls") and has_calls:
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if isinstance(stop, str) and stop in (stop_sequences or ()):
        return "stop_sequence", stop
    return ("end_turn", None) if finish_reason == "stop" else (finish_reason, None)


def _usage(prompt_tokens: int, cached_tokens: int, output_tokens: int) -> dict:
    return {"input_tokens": prompt_tokens - cached_tokens, "output_tokens": output_tokens,
            "cache_read_input_tokens": cached_tokens, "cache_creation_input_tokens": 0}


def _tool_id(call_id: str) -> str:   # Anthropic's ids read toolu_...
    return "toolu_" + call_id.removeprefix("call_")


def _arguments(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:     # cut short by max_tokens: no whole input to give
        return {}
    return value if isinstance(value, dict) else {}


class AnthropicServing:
    def __init__(self, chat: ChatServing) -> None:
        self.chat = chat

    async def count_tokens(self, body: MessagesRequest) -> dict:
        request = body.to_chat(self.chat.reasoning_parser, for_counting=True)
        plan = self.chat.tool_plan(request)
        return {"input_tokens": len(self.chat.chat_prompt(request, plan))}

    async def messages(self, body: MessagesRequest, raw: Request):
        streams, plan = await self.chat.start(body.to_chat(self.chat.reasoning_parser), id_prefix="msg")
        rid = streams.base_id.replace("-", "_", 1)
        if body.stream:
            return StreamingResponse(self._stream(streams, plan, body, rid), media_type="text/event-stream")
        (final,) = await run_until_disconnect(raw, streams.collect())
        c = final.outputs[0]
        if c.finish_reason in ENDED_EARLY:   # e.g. the server's drain deadline: no message to give
            raise APIError(500, f"the request ended early: {c.error or c.finish_reason}")
        answer = self.chat.answer(c, plan)
        reason, sequence = stop_reason(answer.finish_reason, c.stop_reason, body.stop_sequences, bool(answer.calls))
        return JSONResponse({"id": rid, "type": "message", "role": "assistant", "model": body.model,
                             "content": self._content(answer), "stop_reason": reason, "stop_sequence": sequence,
                             "usage": _usage(len(final.prompt_token_ids), final.num_cached_tokens,
                                             len(c.token_ids))})

    @staticmethod
    def _content(answer: ChatAnswer) -> list[dict]:
        blocks: list[dict] = []
        if answer.reasoning:
            blocks.append({"type": "thinking", "thinking": answer.reasoning, "signature": ""})
        if answer.content:
            blocks.append({"type": "text", "text": answer.content})
        for call in answer.calls:
            blocks.append({"type": "tool_use", "id": _tool_id(call.id), "name": call.name,
                           "input": _arguments(call.arguments)})
        return blocks

    async def _stream(self, streams: Streams, plan: ToolPlan, body: MessagesRequest, rid: str) -> AsyncIterator[str]:
        first = streams.firsts[0]
        num_prompt, num_cached = len(first.prompt_token_ids), first.num_cached_tokens
        yield event("message_start", {"type": "message_start", "message": {
            "id": rid, "type": "message", "role": "assistant", "model": body.model, "content": [],
            "stop_reason": None, "stop_sequence": None, "usage": _usage(num_prompt, num_cached, 0)}})
        blocks = BlockStream()
        try:
            async for piece in self.chat.pieces(streams, plan):
                for item in blocks.feed(piece.deltas) + (blocks.close() if piece.finish_reason else []):
                    yield self._block_event(item.kind, item.block, item.piece)
                if piece.finish_reason in ENDED_EARLY:
                    c = piece.choice
                    yield event("error", anthropic_error_body(500, f"the request ended early: {c.error or c.finish_reason}"))
                elif piece.finish_reason is not None:
                    c = piece.choice
                    has_calls = any(b.kind is BlockKind.TOOL_CALL for b in blocks.blocks)
                    reason, sequence = stop_reason(piece.finish_reason, c.stop_reason, body.stop_sequences, has_calls)
                    usage = _usage(num_prompt, piece.out.num_cached_tokens, len(c.token_ids))
                    yield event("message_delta", {"type": "message_delta", "usage": usage,
                                                  "delta": {"stop_reason": reason, "stop_sequence": sequence}})
                    yield event("message_stop", {"type": "message_stop"})
        except APIError as exc:
            yield event("error", anthropic_error_body(exc.status, exc.message))

    @staticmethod
    def _block_event(kind: str, block: Block, piece: str) -> str:
        if kind == "start":
            start = {BlockKind.TEXT: {"type": "text", "text": ""},
                     BlockKind.REASONING: {"type": "thinking", "thinking": "", "signature": ""},
                     BlockKind.TOOL_CALL: {"type": "tool_use", "id": _tool_id(block.call_id or uuid.uuid4().hex),
                                           "name": block.name, "input": {}}}[block.kind]
            return event("content_block_start", {"type": "content_block_start", "index": block.index,
                                                 "content_block": start})
        if kind == "stop":
            return event("content_block_stop", {"type": "content_block_stop", "index": block.index})
        delta = {BlockKind.TEXT: {"type": "text_delta", "text": piece},
                 BlockKind.REASONING: {"type": "thinking_delta", "thinking": piece},
                 BlockKind.TOOL_CALL: {"type": "input_json_delta", "partial_json": piece}}[block.kind]
        return event("content_block_delta", {"type": "content_block_delta", "index": block.index, "delta": delta})
