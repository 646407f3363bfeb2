"""/v1/responses: OpenAI's Responses API over the chat path, stateless.

The request becomes a chat request (``responses_protocol``), runs through ``ChatServing`` like any
chat, and its answer is rendered as a response object: output items (``reasoning`` with its text,
``message`` with ``output_text``, ``function_call``), ``status`` (``completed``, or ``incomplete``
with ``max_output_tokens`` as the reason) and ``usage``. A stream is the API's typed events, each
with its ``sequence_number``: ``response.created``, ``response.in_progress``, per item
``response.output_item.added`` ... ``response.output_item.done`` (a message's
``response.content_part.added`` / ``response.output_text.delta`` / ``.done``, a call's
``response.function_call_arguments.delta`` / ``.done``, reasoning's ``response.reasoning_text.delta``
/ ``.done``), then ``response.completed``, ``response.incomplete`` or ``response.failed``.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from duoserve.entrypoints.blocks import Block, BlockKind, BlockStream
from duoserve.entrypoints.errors import APIError
from duoserve.entrypoints.responses_protocol import ResponsesRequest
from duoserve.entrypoints.serving import Streams, run_until_disconnect
from duoserve.entrypoints.serving_chat import ChatServing
from duoserve.entrypoints.tools import ToolPlan
from duoserve.outputs import CompletionOutput


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def item_of(block: Block, done: bool) -> dict:
    """The output item a block is, in progress (empty, as ``output_item.added`` shows it) or done."""
    status = "completed" if done else "in_progress"
    text = block.text if done else ""
    if block.kind is BlockKind.TEXT:
        content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if done else []
        return {"type": "message", "id": block.item_id, "status": status, "role": "assistant", "content": content}
    if block.kind is BlockKind.REASONING:
        content = [{"type": "reasoning_text", "text": text}] if done else []
        return {"type": "reasoning", "id": block.item_id, "summary": [], "content": content, "status": status}
    return {"type": "function_call", "id": block.item_id, "call_id": block.call_id, "name": block.name,
            "arguments": text, "status": status}


class ResponsesServing:
    def __init__(self, chat: ChatServing) -> None:
        self.chat = chat

    async def create(self, body: ResponsesRequest, raw: Request):
        streams, plan = await self.chat.start(body.to_chat(self.chat.reasoning_parser), id_prefix="resp")
        head = self._head(body, streams.base_id.replace("-", "_", 1), plan)
        if body.stream:
            return StreamingResponse(self._stream(streams, plan, head), media_type="text/event-stream")
        (final,) = await run_until_disconnect(raw, self.chat.base._collect(streams, 1))
        c = final.outputs[0]
        answer = self.chat.answer(c, plan)
        blocks = []
        for kind, text in ((BlockKind.REASONING, answer.reasoning), (BlockKind.TEXT, answer.content)):
            if text:
                blocks.append(Block(kind, len(blocks), text))
        blocks += [Block(BlockKind.TOOL_CALL, len(blocks), call.arguments, call.id, call.name) for call in answer.calls]
        return JSONResponse(self._finished(head, blocks, c, len(final.prompt_token_ids), final.num_cached_tokens))

    def _head(self, body: ResponsesRequest, rid: str, plan: ToolPlan) -> dict:
        """The response object's fields known before the answer."""
        return {"id": rid, "object": "response", "created_at": int(time.time()), "status": "in_progress",
                "model": self.chat.base.model_name, "output": [], "error": None, "incomplete_details": None,
                "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
                "temperature": body.temperature, "top_p": body.top_p,
                "parallel_tool_calls": body.parallel_tool_calls is not False,
                "tool_choice": body.tool_choice or ("auto" if body.tools else "none"),
                "tools": body.tools or [], "text": body.text or {"format": {"type": "text"}},
                "reasoning": body.reasoning, "store": False, "previous_response_id": None, "metadata": {},
                "truncation": "disabled", "usage": None}

    @staticmethod
    def _finished(head: dict, blocks: list[Block], c: CompletionOutput, num_prompt: int, num_cached: int) -> dict:
        """The response once its answer ended: completed, incomplete (max_output_tokens), or failed
        (the request ended early: an engine's error, the server's drain deadline)."""
        for block in blocks:
            block.item_id = block.item_id or _ids(block)
        status = {"length": "incomplete", "error": "failed", "abort": "failed"}.get(c.finish_reason, "completed")
        num_output = len(c.token_ids)
        return {**head, "status": status,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "error": {"code": "server_error", "message": f"the request ended early: {c.error or c.finish_reason}"}
                if status == "failed" else None,
                "output": [item_of(b, done=True) for b in blocks],
                "usage": {"input_tokens": num_prompt, "input_tokens_details": {"cached_tokens": num_cached},
                          "output_tokens": num_output, "output_tokens_details": {"reasoning_tokens": 0},
                          "total_tokens": num_prompt + num_output}}

    async def _stream(self, streams: Streams, plan: ToolPlan, head: dict) -> AsyncIterator[str]:
        sequence = 0

        def event(kind: str, /, **data) -> str:
            nonlocal sequence
            sequence += 1
            return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': sequence - 1, **data})}\n\n"

        yield event("response.created", response=head)
        yield event("response.in_progress", response=head)
        blocks = BlockStream()
        try:
            async for piece in self.chat.pieces(streams, plan):
                for item in blocks.feed(piece.deltas) + (blocks.close() if piece.finish_reason else []):
                    for name, data in _item_events(item.kind, item.block, item.piece):
                        yield event(name, **data)
                if piece.finish_reason is not None:
                    c, out = piece.choice, piece.out
                    response = self._finished(head, blocks.blocks, c, len(out.prompt_token_ids), out.num_cached_tokens)
                    yield event(f"response.{response['status']}", response=response)
        except APIError as exc:
            yield event("error", code=str(exc.status), message=exc.message, param=exc.param)


def _ids(block: Block) -> str:
    return _item_id({BlockKind.TEXT: "msg", BlockKind.REASONING: "rs", BlockKind.TOOL_CALL: "fc"}[block.kind])


def _item_events(kind: str, block: Block, piece: str) -> list[tuple[str, dict]]:
    """The Responses events of one block event (a block is one output item, at its index)."""
    where = {"output_index": block.index}
    if kind == "start":
        block.item_id = _ids(block)
        events: list[tuple[str, dict]] = [("response.output_item.added", {**where, "item": item_of(block, done=False)})]
        if block.kind is BlockKind.TEXT:
            events.append(("response.content_part.added", {
                **where, "item_id": block.item_id, "content_index": 0,
                "part": {"type": "output_text", "text": "", "annotations": [], "logprobs": []}}))
        return events
    at = {**where, "item_id": block.item_id}
    if kind == "delta":
        name = {BlockKind.TEXT: "response.output_text.delta", BlockKind.REASONING: "response.reasoning_text.delta",
                BlockKind.TOOL_CALL: "response.function_call_arguments.delta"}[block.kind]
        extra = {"content_index": 0, "logprobs": []} if block.kind is BlockKind.TEXT else \
            {"content_index": 0} if block.kind is BlockKind.REASONING else {}
        return [(name, {**at, **extra, "delta": piece})]
    done = item_of(block, done=True)
    if block.kind is BlockKind.TEXT:
        events = [("response.output_text.done", {**at, "content_index": 0, "text": block.text, "logprobs": []}),
                  ("response.content_part.done", {**at, "content_index": 0, "part": done["content"][0]})]
    elif block.kind is BlockKind.REASONING:
        events = [("response.reasoning_text.done", {**at, "content_index": 0, "text": block.text})]
    else:
        events = [("response.function_call_arguments.done", {**at, "name": block.name, "arguments": block.text})]
    return events + [("response.output_item.done", {**where, "item": done})]
