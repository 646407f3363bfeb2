"""/v1/chat/completions (through the model's chat template, with tools: ``tools.py``) and the simple
/generate API."""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from duoserve.entrypoints.errors import APIError
from duoserve.entrypoints.protocol import ChatCompletionRequest, GenerateRequest
from duoserve.entrypoints.reasoning import ReasoningStream, split_reasoning
from duoserve.entrypoints.serving import OpenAIServing
from duoserve.entrypoints.streams import Streams, checked_params, run_until_disconnect, sse, usage
from duoserve.entrypoints.tool_formats import GENERIC, render_generic, tool_format
from duoserve.entrypoints.tools import ToolCall, ToolPlan, ToolStream, for_template
from duoserve.outputs import CompletionOutput, RequestOutput


@dataclass(frozen=True)
class ChatAnswer:
    """A finished chat choice as every surface reads it."""
    reasoning: str | None
    content: str | None
    calls: list[ToolCall]
    finish_reason: str | None   # OpenAI's: stop, length, tool_calls, abort, error
    stop_reason: int | str | None


@dataclass
class ChatPiece:
    """One snapshot of one streamed choice: what to send for it."""
    out: RequestOutput            # the request's snapshot (prompt size, cached tokens)
    choice: CompletionOutput
    deltas: list[dict]            # OpenAI-shaped: {"reasoning_content"}, {"content"}, {"tool_calls": [...]}
    logprobs: list | None         # entries of the tokens since the last piece (when asked)
    finish_reason: str | None     # set once the choice is finished
    first: bool = False           # the choice's first piece


def _chat_logprobs(tokenizer, entries: list) -> dict:
    def item(token_id: int, logprob: float) -> dict:
        text = tokenizer.decode([token_id], skip_special_tokens=False)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {"content": [{**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]}
                        for e in entries], "refusal": None}


class ChatServing:
    def __init__(self, base: OpenAIServing, tool_call_parser: str | None = None,
                 reasoning_parser: str | None = None) -> None:
        self.base = base
        self.engine = base.engine
        self.tool_call_parser = tool_call_parser   # None: the one the model's chat template speaks
        self.reasoning_parser = reasoning_parser

    def _template_format(self) -> str:
        tokenizer = self.engine.tokenizer
        return tool_format(tokenizer.chat_template if tokenizer is not None else None)

    def tool_format(self) -> str:
        """How the model writes tool calls: ``--tool-call-parser``, else what its chat template
        speaks (``generic`` for a template that shows no tools)."""
        return self.tool_call_parser or self._template_format()

    def template_shows_tools(self) -> bool:
        return self._template_format() != GENERIC

    def tool_plan(self, body: ChatCompletionRequest) -> ToolPlan:
        """The request's tool plan; ``auto`` holds a started call to the tools' grammar unless
        another grammar holds the whole answer or a reasoning model thinks first (its thoughts
        may name a tool's tags: the calls are then only read)."""
        return checked_params(lambda: body.tool_plan(self.tool_format(), lazy=self.reasoning_parser is None
                                              and body.structured_outputs is None))

    def chat_prompt(self, body: ChatCompletionRequest, plan: ToolPlan | None = None) -> list[int]:
        if not self.engine.started:
            raise APIError(503, f"the engine is unavailable: {self.engine.not_ready_reason()}")
        tokenizer = self.engine.tokenizer
        if tokenizer is None or not tokenizer.chat_template:
            raise APIError(400, "this model has no chat template: start the server with --chat-template (a Jinja "
                           "template or a file holding one), or use /v1/completions", param="messages")
        messages = for_template([m.for_template() for m in body.messages])
        tools = plan.tools if plan is not None else []
        if not self.template_shows_tools():   # the tools in the system prompt, the generic format's JSON asked
            auto = plan is not None and plan.mode == "auto" and plan.parser == GENERIC
            messages, tools = render_generic(messages, tools, auto), []
        final = body.messages[-1]
        if body.continue_final_message and (final.role != "assistant" or not final.text()):
            raise APIError(400, "continue_final_message needs a final assistant message with text to go on from",
                           param="messages")
        generation_prompt = body.add_generation_prompt and not body.continue_final_message
        try:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt,
                                                 tools=tools or None, **(body.chat_template_kwargs or {}))
        except Exception as exc:  # the template itself may refuse a conversation
            raise APIError(400, f"the chat template refused these messages: {exc}", param="messages") from exc
        if body.continue_final_message:   # cut the template's end of turn after the final message
            opened = final.text().rstrip()
            end = text.rfind(opened)
            if end < 0:
                raise APIError(400, "the chat template rewrites the final assistant message, so the answer "
                               "cannot go on from it", param="messages")
            text = text[:end + len(opened)]
        return tokenizer.encode(text, add_special_tokens=False)

    async def start(self, body: ChatCompletionRequest, id_prefix: str = "chatcmpl") -> tuple[Streams, ToolPlan]:
        """Validate a chat request into its prompt, sampling parameters and tool plan, and start
        its engine stream: the one entry of every chat-shaped surface (chat completions,
        Anthropic's Messages, OpenAI's Responses), which then only render its answer."""
        self.base.check_model(body.model)
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        params = checked_params(lambda: body.sampling_params(max_tokens, logprobs))
        plan = self.tool_plan(body)
        call_grammar = plan.grammar()
        if call_grammar is not None:   # a named or required call: generated under its schema
            params = dataclasses.replace(params, structured_outputs=call_grammar)
        # deepseek_r1's template opens <think> in the prompt: a grammar from the first token would
        # contradict it (qwen3's model opens it itself; under a grammar it answers without thinking)
        thinking_off = (body.chat_template_kwargs or {}).get("enable_thinking") is False
        if params.structured_outputs is not None and self.reasoning_parser == "deepseek_r1" and not thinking_off:
            raise APIError(400, "a grammar (response_format, structured_outputs, a required or named tool call) "
                           "would forbid the model's reasoning, and applying it only after </think> is not "
                           "supported yet: send chat_template_kwargs {\"enable_thinking\": false}, or leave it "
                           "out", param=params.structured_outputs.param)
        prompt = self.chat_prompt(body, plan)
        streams = Streams(self.engine, [prompt], params, f"{id_prefix}-{uuid.uuid4().hex}", prompt_param="messages")
        await streams.start()
        return streams, plan

    def answer(self, c: CompletionOutput, plan: ToolPlan) -> ChatAnswer:
        """A finished choice read back: its reasoning, content and tool calls."""
        reasoning, text = split_reasoning(self.reasoning_parser, c.text) if self.reasoning_parser else (None, c.text)
        content, calls = plan.calls(text or "") if text is not None else (None, [])
        finish = "tool_calls" if calls and c.finish_reason == "stop" and plan.mode != "named" else c.finish_reason
        return ChatAnswer(reasoning, content, calls, finish, c.stop_reason)

    async def pieces(self, streams: Streams, plan: ToolPlan, logprobs: bool = False) -> AsyncIterator[ChatPiece]:
        """A streamed chat answer as pieces: per engine snapshot of a choice, its OpenAI-shaped
        deltas (``reasoning_content``, ``content``, ``tool_calls``) and, once finished, its finish
        reason. Tokens whose text was held back (a stop string's possible start) went out with no
        piece: their log-probabilities go with the next one."""
        started: set[int] = set()
        logged: dict[int, int] = {}   # per choice, tokens whose log-probabilities went out
        tool_streams: dict[int, ToolStream] = {}
        reasoning_streams: dict[int, ReasoningStream] = {}
        async for _, out in streams.merged():
            for c in out.outputs:
                first = c.index not in started
                started.add(c.index)
                if not c.delta_text and not c.finished:
                    if first:
                        yield ChatPiece(out, c, [], None, None, first=True)
                    continue
                lp = None
                if logprobs and c.logprobs:
                    lp = c.logprobs[logged.get(c.index, 0):len(c.token_ids)]
                    logged[c.index] = len(c.token_ids)
                tools = tool_streams.setdefault(c.index, ToolStream(plan))
                text, deltas = c.delta_text, []
                if self.reasoning_parser:
                    thinking = reasoning_streams.setdefault(c.index, ReasoningStream(self.reasoning_parser))
                    reasoning, text = thinking.feed(c.delta_text, c.finished)
                    deltas = [{"reasoning_content": reasoning}] if reasoning else []
                deltas = deltas + tools.feed(text, c.finished)
                finish = tools.finish_reason(c.finish_reason) if c.finished else None
                yield ChatPiece(out, c, deltas, lp, finish, first=first)

    async def chat(self, body: ChatCompletionRequest, raw: Request):
        streams, plan = await self.start(body)
        rid, created = streams.base_id, int(time.time())
        if body.stream:
            return StreamingResponse(self._stream(streams, body, rid, created, plan), media_type="text/event-stream")
        (final,) = await run_until_disconnect(raw, streams.collect())
        choices = []
        for c in final.outputs:
            answer = self.answer(c, plan)
            message = {"role": "assistant", "content": answer.content, "refusal": None}
            if self.reasoning_parser:   # vLLM's older name, and the one OpenAI-compatible clients now read
                message["reasoning_content"] = message["reasoning"] = answer.reasoning
            if answer.calls:
                message["tool_calls"] = [call.as_dict() for call in answer.calls]
            choices.append({"index": c.index, "message": message,
                            "logprobs": _chat_logprobs(self.engine.tokenizer, c.logprobs) if body.logprobs else None,
                            "finish_reason": answer.finish_reason, "stop_reason": c.stop_reason})
        num_completion = sum(len(c.token_ids) for c in final.outputs)
        return JSONResponse({"id": rid, "object": "chat.completion", "created": created,
                             "model": self.base.model_name, "choices": choices,
                             "usage": usage(len(final.prompt_token_ids), num_completion, final.num_cached_tokens)})

    async def _stream(self, streams: Streams, body: ChatCompletionRequest, rid: str,
                      created: int, plan: ToolPlan) -> AsyncIterator[str]:
        opts = body.stream_options
        head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": self.base.model_name}
        num_prompt = num_cached = 0
        counts: dict[int, int] = {}
        try:
            async for piece in self.pieces(streams, plan, body.logprobs):
                c = piece.choice
                num_prompt, num_cached = len(piece.out.prompt_token_ids), piece.out.num_cached_tokens
                if piece.first:
                    yield sse({**head, "choices": [{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                                    "logprobs": None, "finish_reason": None}]})
                if not c.delta_text and not c.finished:
                    continue
                counts[c.index] = len(c.token_ids)
                lp = None if piece.logprobs is None else _chat_logprobs(self.engine.tokenizer, piece.logprobs)
                deltas = piece.deltas or [{}]
                for k, delta in enumerate(deltas):
                    last = k == len(deltas) - 1
                    if not delta and not last:
                        continue
                    if "reasoning_content" in delta:
                        delta = {**delta, "reasoning": delta["reasoning_content"]}
                    chunk = {**head, "choices": [{
                        "index": c.index, "delta": delta, "logprobs": lp if k == 0 else None,
                        "finish_reason": piece.finish_reason if last else None}]}
                    if opts is not None and opts.continuous_usage_stats:
                        chunk["usage"] = usage(num_prompt, sum(counts.values()), num_cached)
                    if delta or last and (c.finished or lp is not None):
                        yield sse(chunk)
            if opts is not None and opts.include_usage:
                yield sse({**head, "choices": [], "usage": usage(num_prompt, sum(counts.values()), num_cached)})
        except APIError as exc:
            yield sse({"error": {"message": exc.message, "type": "server_error", "param": None, "code": "503"}})
        yield sse("[DONE]")

    # ---- /generate ----------------------------------------------------------------------

    async def generate(self, body: GenerateRequest, raw: Request):
        """The seed documents' simple API: the completion only (no echo), its token ids and usage."""
        params = checked_params(lambda: body.sampling_params(body.max_tokens, body.logprobs))
        rid = f"gen-{uuid.uuid4().hex}"
        streams = Streams(self.engine, [body.prompt], params, rid)
        await streams.start()
        if body.stream:
            return StreamingResponse(self._stream_generate(streams), media_type="text/event-stream")
        (final,) = await run_until_disconnect(raw, streams.collect())
        c = final.outputs[0]
        result = {"text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason,
                  "usage": usage(len(final.prompt_token_ids), len(c.token_ids), final.num_cached_tokens)}
        if params.n > 1:
            result["choices"] = [{"index": o.index, "text": o.text, "token_ids": o.token_ids,
                                  "finish_reason": o.finish_reason} for o in final.outputs]
        return JSONResponse(result)

    async def _stream_generate(self, streams: Streams) -> AsyncIterator[str]:
        try:
            async for _, out in streams.merged():
                for c in out.outputs:
                    if c.delta_text or c.delta_token_ids or c.finished:
                        event = {"index": c.index, "text": c.delta_text, "token_ids": c.delta_token_ids,
                                 "finish_reason": c.finish_reason}
                        if c.finished:
                            event["usage"] = usage(len(out.prompt_token_ids), len(c.token_ids), out.num_cached_tokens)
                        yield sse(event)
        except APIError as exc:
            yield sse({"error": {"message": exc.message, "type": "server_error", "param": None, "code": "503"}})
        yield sse("[DONE]")
