"""/v1/responses: OpenAI's Responses API over the chat path, over HTTP and a WebSocket.

The request becomes a chat request (``responses_protocol``; with ``previous_response_id`` the
stored conversation comes first), runs through ``ChatServing`` like any chat, and its answer is a
sequence of the API's typed events, each with its ``sequence_number``: ``response.created``,
``response.in_progress``, per item ``response.output_item.added`` ... ``response.output_item.done``
(a message's ``response.content_part.added`` / ``response.output_text.delta`` / ``.done``, a call's
``response.function_call_arguments.delta`` / ``.done``, reasoning's
``response.reasoning_text.delta`` / ``.done``), then ``response.completed``, ``response.incomplete``
(``max_output_tokens``) or ``response.failed``. A stream sends them as server-sent events, a
WebSocket (``response.create`` messages, one response at a time) as JSON messages, and a plain
request answers the last one's response object.

The response is stored (``responses_store``) unless ``store: false``; a WebSocket also keeps its
connection's recent responses, stored or not, for ``previous_response_id`` on it (a continuation
that fails forgets the response it named). ``background: true`` answers at once with the response
queued and goes on generating; ``GET`` polls it, ``POST .../cancel`` stops it.
``/v1/responses/compact`` folds a conversation into one ``compaction`` item that a later request
gives back as input: the items themselves, not a summary (nothing is shortened).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass

from fastapi import Request, WebSocket, WebSocketDisconnect
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError

from duoserve.entrypoints.blocks import Block, BlockKind, BlockStream
from duoserve.entrypoints.errors import APIError, error_body
from duoserve.entrypoints.protocol import ChatCompletionRequest
from duoserve.entrypoints.responses_protocol import (LOGPROBS_INCLUDE, ResponsesRequest, compaction_of,
                                                     conversation_length, expand_compactions, messages_of, tool_echo)
from duoserve.entrypoints.responses_store import ResponseStore, StoredResponse, with_ids
from duoserve.entrypoints.streams import Streams, run_until_disconnect
from duoserve.entrypoints.serving_chat import ChatServing, _chat_logprobs
from duoserve.entrypoints.tools import ToolPlan

TERMINAL = ("response.completed", "response.incomplete", "response.failed")
SOCKET_CACHE = 16   # a WebSocket's recent responses kept for previous_response_id


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def item_of(block: Block, done: bool, logprobs: list | None = None) -> dict:
    """The output item a block is, in progress (empty, as ``output_item.added`` shows it) or done."""
    status = "completed" if done else "in_progress"
    text = block.text if done else ""
    if block.kind is BlockKind.TEXT:
        content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}] if done else []
        return {"type": "message", "id": block.item_id, "status": status, "role": "assistant", "content": content}
    if block.kind is BlockKind.REASONING:
        content = [{"type": "reasoning_text", "text": text}] if done else []
        return {"type": "reasoning", "id": block.item_id, "summary": [], "content": content, "status": status}
    return {"type": "function_call", "id": block.item_id, "call_id": block.call_id, "name": block.name,
            "arguments": text, "status": status}


@dataclass
class Turn:
    """One response being generated."""
    body: ResponsesRequest
    streams: Streams
    plan: ToolPlan
    head: dict                 # the response object before its answer
    history: list[dict]        # the conversation before this turn's input
    input_items: list[dict]
    final: dict | None = None  # the response once ended


class ResponsesServing:
    def __init__(self, chat: ChatServing, store: ResponseStore | None = None) -> None:
        self.chat = chat
        self.store = store if store is not None else ResponseStore()

    # ---- one response -----------------------------------------------------------------------

    def _history(self, body: ResponsesRequest, cache: dict[str, StoredResponse] | None = None) -> list[dict]:
        previous = body.previous_response_id
        if previous is None:
            return []
        stored = (cache or {}).get(previous) or self.store.get(previous)
        if stored is None:
            raise APIError(400, f"previous_response_id {previous!r} is not found: it was not stored (store: false "
                           "outside its WebSocket), was deleted, or is older than the store keeps",
                           param="previous_response_id", code="previous_response_not_found")
        if stored.response["status"] in ("queued", "in_progress"):
            raise APIError(400, f"previous_response_id {previous!r} is still {stored.response['status']}",
                           param="previous_response_id")
        return stored.conversation()

    async def begin(self, body: ResponsesRequest, cache: dict[str, StoredResponse] | None = None) -> Turn:
        history = self._history(body, cache)
        streams, plan = await self.chat.start(self._fitted(body, history), id_prefix="resp")
        head = self._head(body, streams.base_id.replace("-", "_", 1))
        return Turn(body, streams, plan, head, history, with_ids(body.items()))

    def _fitted(self, body: ResponsesRequest, history: list[dict]) -> ChatCompletionRequest:
        """The turn's chat request; with ``truncation: "auto"`` the oldest items are dropped, one
        at a time, while the prompt and ``max_output_tokens`` (at least one token) overflow the
        context; the newest item always stays."""
        request = body.to_chat(history, self.chat.reasoning_parser)
        if body.truncation != "auto" or self.chat.engine.max_model_len is None:
            return request
        room = self.chat.engine.max_model_len - (body.max_output_tokens or 1)
        for drop in range(1, conversation_length(history, body.items())):
            if len(self.chat.chat_prompt(request, self.chat.tool_plan(request))) <= room:
                break
            request = body.to_chat(history, self.chat.reasoning_parser, drop)
        return request

    def _head(self, body: ResponsesRequest, rid: str) -> dict:
        """The response object's fields known before the answer: the request's settings echoed,
        the API's defaults where it left them out."""
        extra = body.model_extra or {}
        fmt = (body.text or {}).get("format") or {"type": "text"}
        if fmt.get("type") == "json_schema":
            fmt = {"type": "json_schema", "name": fmt.get("name"), "description": fmt.get("description"),
                   "schema": fmt.get("schema"), "strict": bool(fmt.get("strict"))}
        return {"id": rid, "object": "response", "created_at": int(time.time()), "completed_at": None,
                "status": "in_progress", "background": bool(body.background), "error": None,
                "incomplete_details": None, "instructions": body.instructions,
                "max_output_tokens": body.max_output_tokens, "max_tool_calls": body.max_tool_calls,
                "model": self.chat.base.model_name, "output": [], "parallel_tool_calls": body.parallel_tool_calls
                is not False, "previous_response_id": body.previous_response_id,
                "reasoning": {"effort": (body.reasoning or {}).get("effort"),
                              "summary": (body.reasoning or {}).get("summary")},
                "store": body.store is not False,
                "temperature": 1.0 if body.temperature is None else body.temperature,
                "top_p": 1.0 if body.top_p is None else body.top_p,
                "presence_penalty": body.presence_penalty or 0.0, "frequency_penalty": body.frequency_penalty or 0.0,
                "top_logprobs": body.top_logprobs or 0,
                "text": {**(body.text or {}), "format": fmt},
                "tool_choice": body.tool_choice or ("auto" if body.tools else "none"),
                "tools": [tool_echo(t) for t in body.tools or ()], "truncation": body.truncation or "disabled",
                "usage": None,
                "metadata": extra.get("metadata") or {}, "user": extra.get("user"),
                "service_tier": extra.get("service_tier") or "default",
                "safety_identifier": extra.get("safety_identifier"), "prompt_cache_key": extra.get("prompt_cache_key")}

    async def events(self, turn: Turn) -> AsyncIterator[dict]:
        """The turn's events, each with its sequence number; the last is terminal (or an error)."""
        sequence = 0

        def event(kind: str, /, **data) -> dict:
            nonlocal sequence
            sequence += 1
            return {"type": kind, "sequence_number": sequence - 1, **data}

        yield event("response.created", response=turn.head)
        yield event("response.in_progress", response=turn.head)
        blocks, logprobs = BlockStream(), {}
        want_logprobs = LOGPROBS_INCLUDE in (turn.body.include or ())
        try:
            async for piece in self.chat.pieces(turn.streams, turn.plan, want_logprobs):
                entries = _chat_logprobs(self.chat.engine.tokenizer, piece.logprobs)["content"] \
                    if piece.logprobs else []
                for item in blocks.feed(piece.deltas) + (blocks.close() if piece.finish_reason else []):
                    if item.kind == "delta" and item.block.kind is BlockKind.TEXT:
                        logprobs.setdefault(item.block.index, []).extend(entries)
                    for name, data in _item_events(item.kind, item.block, item.piece,
                                                   logprobs.get(item.block.index), entries):
                        yield event(name, **data)
                if piece.finish_reason is not None:
                    out = piece.out
                    turn.final = self._finished(turn.head, turn.body.max_tool_calls, blocks.blocks, piece.choice,
                                                len(out.prompt_token_ids), out.num_cached_tokens, logprobs)
                    self._record(turn)
                    yield event(f"response.{turn.final['status']}", response=turn.final)
        except APIError as exc:
            turn.final = {**turn.head, "status": "failed", "completed_at": int(time.time()),
                          "error": {"code": "server_error", "message": exc.message}}
            self._record(turn)
            yield event("error", code=exc.code or str(exc.status), message=exc.message, param=exc.param,
                        error={"type": "server_error", "code": exc.code or str(exc.status), "message": exc.message,
                               "param": exc.param})

    @staticmethod
    def _finished(head: dict, max_tool_calls: int | None, blocks: list[Block], c, num_prompt: int, num_cached: int,
                  logprobs: dict[int, list]) -> dict:
        """The response once its answer ended: completed, incomplete (max_output_tokens), or failed
        (the request ended early: an engine's error, the server's drain deadline)."""
        for block in blocks:
            block.item_id = block.item_id or _ids(block)
        calls = [b for b in blocks if b.kind is BlockKind.TOOL_CALL]
        limit = max_tool_calls
        if limit is not None and len(calls) > limit:   # calls beyond the request's limit are not made
            blocks = [b for b in blocks if b.kind is not BlockKind.TOOL_CALL or b in calls[:limit]]
        status = {"length": "incomplete", "error": "failed", "abort": "failed"}.get(c.finish_reason, "completed")
        num_output = len(c.token_ids)
        return {**head, "status": status, "completed_at": int(time.time()),
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "error": {"code": "server_error", "message": f"the request ended early: {c.error or c.finish_reason}"}
                if status == "failed" else None,
                "output": [item_of(b, True, logprobs.get(b.index)) for b in blocks],
                "usage": {"input_tokens": num_prompt, "input_tokens_details": {"cached_tokens": num_cached},
                          "output_tokens": num_output, "output_tokens_details": {"reasoning_tokens": 0},
                          "total_tokens": num_prompt + num_output}}

    def _record(self, turn: Turn) -> None:
        if turn.head["store"]:
            stored = self.store.get(turn.head["id"])
            if stored is None:
                self.store.put(StoredResponse(turn.final, turn.input_items, turn.history))
            else:   # a background response: its entry was made when it was queued
                stored.response = turn.final
                self.store.save(stored)

    # ---- HTTP -------------------------------------------------------------------------------

    async def create(self, body: ResponsesRequest, raw: Request):
        body.check()
        turn = await self.begin(body)
        if body.background:
            return JSONResponse(self._background(turn))
        if body.stream:
            return StreamingResponse(self._sse(turn), media_type="text/event-stream")
        await run_until_disconnect(raw, self._drain(turn))
        return JSONResponse(turn.final)

    async def _drain(self, turn: Turn) -> None:
        async for event in self.events(turn):
            if event["type"] == "error":
                raise APIError(503, event["message"])

    async def _sse(self, turn: Turn) -> AsyncIterator[str]:
        async for event in self.events(turn):
            yield f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"

    def _background(self, turn: Turn) -> dict:
        stored = StoredResponse({**turn.head, "status": "queued"}, turn.input_items, turn.history)
        self.store.put(stored)

        async def work() -> None:
            try:
                async for event in self.events(turn):
                    if event["type"] == "response.in_progress":
                        stored.response = {**turn.head, "status": "in_progress"}
                        self.store.save(stored)
            except asyncio.CancelledError:
                stored.response = {**stored.response, "status": "cancelled", "completed_at": int(time.time())}
                self.store.save(stored)
                raise
            except Exception as exc:   # not the engine's errors (events() answers those): a bug, shown
                stored.response = {**stored.response, "status": "failed", "completed_at": int(time.time()),
                                   "error": {"code": "server_error", "message": f"{type(exc).__name__}: {exc}"}}
                self.store.save(stored)
                raise

        stored.task = asyncio.create_task(work())
        return stored.response

    def _stored(self, response_id: str) -> StoredResponse:
        stored = self.store.get(response_id)
        if stored is None:
            raise APIError(404, f"no stored response with id {response_id!r}", param="response_id")
        return stored

    def get(self, response_id: str) -> dict:
        return self._stored(response_id).response

    def delete(self, response_id: str) -> dict:
        self._stored(response_id)
        self.store.delete(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    async def cancel(self, response_id: str) -> dict:
        stored = self._stored(response_id)
        if not stored.response.get("background"):
            raise APIError(400, "only a background response can be cancelled", param="response_id")
        if stored.task is not None and not stored.task.done():
            stored.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await stored.task
        return stored.response

    def input_items(self, response_id: str, limit: int = 20, order: str = "desc", after: str | None = None) -> dict:
        if not 1 <= limit <= 100:
            raise APIError(400, f"limit must be 1 to 100, not {limit}", param="limit")
        if order not in ("asc", "desc"):
            raise APIError(400, f"order must be 'asc' or 'desc', not {order!r}", param="order")
        items = list(self._stored(response_id).input_items)
        if order == "desc":
            items.reverse()
        if after is not None:
            ids = [item["id"] for item in items]
            if after not in ids:
                raise APIError(400, f"no input item {after!r} in response {response_id!r}", param="after")
            items = items[ids.index(after) + 1:]
        page = items[:limit]
        return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}

    async def compact(self, body: ResponsesRequest) -> dict:
        """The conversation (an earlier response's, then the input) as one compaction item."""
        if not body.model:
            raise APIError(400, "model is required", param="model")
        body.check()
        self.chat.base.check_model(body.model)
        items = expand_compactions(self._history(body) + body.items(), "input")
        messages = messages_of([], items, body.instructions)   # refuses what a response would refuse
        request = ChatCompletionRequest.of_translated({"model": body.model, "messages": messages})
        num_input = len(self.chat.chat_prompt(request))
        return {"id": _item_id("cmp"), "object": "response.compaction", "created_at": int(time.time()),
                "output": [{"type": "compaction", "id": _item_id("cmp"), "encrypted_content": compaction_of(items),
                            "created_by": self.chat.base.model_name}],
                "usage": {"input_tokens": num_input, "input_tokens_details": {"cached_tokens": 0},
                          "output_tokens": 0, "output_tokens_details": {"reasoning_tokens": 0},
                          "total_tokens": num_input}}

    # ---- WebSocket ----------------------------------------------------------------------------

    async def socket(self, ws: WebSocket, model_of: Callable[[str | None], AbstractAsyncContextManager]) -> None:
        """OpenAI's WebSocket mode: each ``response.create`` message runs one response, its events
        sent back as messages; an error is an ``error`` message and the connection stays open.
        ``model_of(name)`` holds the model a message names (its ``.responses`` runs the turn)."""
        await ws.accept()
        cache: OrderedDict[str, StoredResponse] = OrderedDict()
        with contextlib.suppress(WebSocketDisconnect):
            while True:
                text = await ws.receive_text()
                body = None
                try:
                    body = self._socket_request(text)
                    async with model_of(body.model) as served:
                        turn = await served.responses.begin(body, cache)
                        async with contextlib.aclosing(served.responses.events(turn)) as events:   # closed: aborted
                            async for event in events:
                                await ws.send_text(json.dumps(event))
                except APIError as exc:
                    await ws.send_text(json.dumps(_socket_error(exc.status, exc.message, exc.param, exc.code)))
                    turn = None
                except (ValueError, TypeError) as exc:   # a value the chat request refuses (ConfigError...)
                    await ws.send_text(json.dumps(_socket_error(400, str(exc), getattr(exc, "field", None), None)))
                    turn = None
                if body is not None and body.previous_response_id is not None and (
                        turn is None or turn.final is None or turn.final["status"] == "failed"):
                    cache.pop(body.previous_response_id, None)   # a failed continuation forgets its base
                if turn is not None and turn.final is not None and turn.final["status"] != "failed":
                    cache[turn.final["id"]] = StoredResponse(turn.final, turn.input_items, turn.history)
                    while len(cache) > SOCKET_CACHE:
                        cache.popitem(last=False)

    def _socket_request(self, text: str) -> ResponsesRequest:
        try:
            message = json.loads(text)
        except json.JSONDecodeError as exc:
            raise APIError(400, f"a message must be JSON: {exc}") from None
        if not isinstance(message, dict) or message.get("type") != "response.create":
            kind = message.get("type") if isinstance(message, dict) else None
            raise APIError(400, f"message type {kind!r} is not supported: send 'response.create'", param="type")
        fields = {k: v for k, v in message.items() if k != "type"}
        for name in ("stream", "background"):
            if fields.pop(name, None):
                raise APIError(400, f"'{name}' does not apply to a WebSocket: every response streams its events",
                               param=name)
        try:
            body = ResponsesRequest.model_validate(fields)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first.get("loc", ()))
            raise APIError(400, f"invalid value for {where}: {first.get('msg')}", param=where or None) from None
        body.check()
        return body


def _socket_error(status: int, message: str, param: str | None, code: str | None) -> dict:
    error = error_body(status, message, param, code)["error"]
    return {"type": "error", "status": status, "error": error}


def _ids(block: Block) -> str:
    return _item_id({BlockKind.TEXT: "msg", BlockKind.REASONING: "rs", BlockKind.TOOL_CALL: "fc"}[block.kind])


def _item_events(kind: str, block: Block, piece: str, logprobs: list | None, entries: list) -> list[tuple[str, dict]]:
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
        extra = {"content_index": 0, "logprobs": entries} if block.kind is BlockKind.TEXT else \
            {"content_index": 0} if block.kind is BlockKind.REASONING else {}
        return [(name, {**at, **extra, "delta": piece})]
    done = item_of(block, True, logprobs)
    if block.kind is BlockKind.TEXT:
        events = [("response.output_text.done", {**at, "content_index": 0, "text": block.text,
                                                  "logprobs": logprobs or []}),
                  ("response.content_part.done", {**at, "content_index": 0, "part": done["content"][0]})]
    elif block.kind is BlockKind.REASONING:
        events = [("response.reasoning_text.done", {**at, "content_index": 0, "text": block.text})]
    else:
        events = [("response.function_call_arguments.done", {**at, "name": block.name, "arguments": block.text})]
    return events + [("response.output_item.done", {**where, "item": done})]
