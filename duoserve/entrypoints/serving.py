"""The generation routes: /v1/completions, /v1/chat/completions and /generate.

Each handler validates the body into SamplingParams (400 naming the parameter on a
bad value), starts one engine stream per prompt, and either collects the streams into
one JSON response or forwards their deltas as server-sent events ending with
``data: [DONE]``. Only text and numbers reach this module: no tensors.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from duoserve.entrypoints.errors import APIError
from duoserve.entrypoints.protocol import CompletionRequest
from duoserve.errors import ConfigError, InvalidInputError, ModelLoadError
from duoserve.frontend.async_engine import AsyncEngine, EngineUnavailableError, QueueFullError
from duoserve.frontend.engine_client import EngineDeadError
from duoserve.outputs import RequestOutput
from duoserve.sampling_params import SamplingParams


def _params(build) -> SamplingParams:
    try:
        return build()
    except ConfigError as exc:
        raise APIError(400, str(exc), param=exc.field) from exc


async def _first(stream: AsyncIterator[RequestOutput], prompt_param: str = "prompt") -> RequestOutput:
    """Start a stream, mapping input errors found at its start to HTTP errors (a prompt problem
    names ``prompt_param``: the chat route's prompt comes from ``messages``)."""
    try:
        return await stream.__anext__()
    except InvalidInputError as exc:
        raise APIError(400, str(exc), param=prompt_param if exc.param == "prompt" else exc.param) from exc
    except QueueFullError as exc:
        raise APIError(429, str(exc), headers={"Retry-After": "1"}) from exc
    except (EngineUnavailableError, EngineDeadError, ModelLoadError) as exc:
        raise APIError(503, f"the engine is unavailable: {exc}") from exc


class Streams:
    """Several engine streams (one per prompt) merged into one, for a single HTTP request."""

    def __init__(self, engine: AsyncEngine, prompts: list, params: SamplingParams, base_id: str,
                 prompt_param: str = "prompt") -> None:
        self.engine, self.base_id = engine, base_id
        self.streams = [engine.generate(p, params, f"{base_id}-{i}") for i, p in enumerate(prompts)]
        self.firsts: list[RequestOutput] = []
        self.prompt_param = prompt_param

    async def start(self) -> None:
        try:
            for stream in self.streams:
                self.firsts.append(await _first(stream, self.prompt_param))
        except BaseException:
            await self.close()
            raise

    async def merged(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, snapshot) in arrival order, the first snapshots included."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, stream: AsyncIterator[RequestOutput]) -> None:
            try:
                async for item in stream:
                    await queue.put((index, item))
            except Exception as exc:
                await queue.put((index, exc))
            finally:
                await queue.put((index, None))

        for index, first in enumerate(self.firsts):
            queue.put_nowait((index, first))
        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(self.streams)
                 if not self.firsts[i].finished]
        remaining = len(tasks)
        try:
            while remaining:
                index, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, Exception):
                    raise APIError(503, str(item))
                else:
                    yield index, item
            while not queue.empty():
                index, item = queue.get_nowait()
                if item is not None and not isinstance(item, Exception):
                    yield index, item
        finally:
            for task in tasks:
                task.cancel()
            await self.close()

    async def close(self) -> None:
        for stream in self.streams:
            with contextlib.suppress(Exception):
                await stream.aclose()


async def run_until_disconnect(raw: Request, work) -> object:
    """Run ``work`` (a coroutine) but cancel it, aborting its requests, if the client goes away."""
    task = asyncio.ensure_future(work)
    while not task.done():
        done, _ = await asyncio.wait({task}, timeout=0.5)
        if not done and await raw.is_disconnected():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
            raise APIError(499, "client disconnected")
    return task.result()


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; ``cached_tokens``: prompt tokens served from the prefix cache (a request
    that asks for prompt log-probabilities computes every prompt token, so it reports 0)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


class OpenAIServing:
    def __init__(self, engine: AsyncEngine, served_model_name: str) -> None:
        self.engine = engine
        self.model_name = served_model_name

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"The model `{model}` does not exist; this server serves `{self.model_name}`",
                           param="model", code="model_not_found")

    # ---- completions --------------------------------------------------------------------

    async def completions(self, body: CompletionRequest, raw: Request):
        self.check_model(body.model)
        if body.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        if body.best_of is not None and body.best_of != body.n:
            raise APIError(400, f"best_of={body.best_of} with n={body.n} is not supported: best_of may only equal n "
                                "(ranking extra samples is not implemented)", param="best_of")
        prompts = body.prompts()
        if not prompts:
            raise APIError(400, "prompt must not be empty", param="prompt")
        logprobs = body.logprobs
        params = _params(lambda: body.sampling_params(body.max_tokens, logprobs,
                                                      logprobs if body.echo and logprobs is not None else None))
        rid = f"cmpl-{uuid.uuid4().hex}"
        streams = Streams(self.engine, prompts, params, rid)
        await streams.start()
        created = int(time.time())
        if body.stream:
            return StreamingResponse(self._stream_completions(streams, body, rid, created),
                                     media_type="text/event-stream")
        finals = await run_until_disconnect(raw, self._collect(streams, len(prompts)))
        choices, num_prompt, num_completion = [], 0, 0
        for i, out in enumerate(finals):
            num_prompt += len(out.prompt_token_ids)
            for comp in out.outputs:
                num_completion += len(comp.token_ids)
                text = comp.text
                lp = None
                if logprobs is not None:
                    lp = self._legacy_logprobs(out, comp, body.echo)
                if body.echo:
                    text = self._prompt_text(out) + text
                choices.append({"index": i * body.n + comp.index, "text": text, "logprobs": lp,
                                "finish_reason": comp.finish_reason, "stop_reason": comp.stop_reason})
        return JSONResponse({"id": rid, "object": "text_completion", "created": created, "model": self.model_name,
                             "choices": choices,
                             "usage": usage(num_prompt, num_completion, sum(o.num_cached_tokens for o in finals))})

    async def _collect(self, streams: Streams, count: int) -> list[RequestOutput]:
        finals: list[RequestOutput | None] = [None] * count
        async for index, out in streams.merged():
            finals[index] = out
        return finals

    def _prompt_text(self, out: RequestOutput) -> str:
        if out.prompt is not None:
            return out.prompt
        return self.engine.tokenizer.decode(out.prompt_token_ids, skip_special_tokens=False)

    def _legacy_logprobs(self, out: RequestOutput, comp, echo: bool) -> dict:
        """OpenAI's legacy completions logprobs over the (echoed prompt and) completion."""
        ids, entries = list(comp.token_ids), list(comp.logprobs or [])
        if echo:
            ids = out.prompt_token_ids + ids
            entries = list(out.prompt_logprobs or [None] * len(out.prompt_token_ids)) + entries
        return self._logprob_lists(ids, entries, 0)

    def _logprob_lists(self, ids: list[int], entries: list, start_offset: int) -> dict:
        """tokens, token_logprobs (None for a first prompt token), top_logprobs and text_offset."""
        tok = self.engine.tokenizer

        def spelled(token_id: int) -> str:   # a model without a tokenizer: vLLM's "token_id:N"
            return f"token_id:{token_id}" if tok is None else tok.decode([token_id], skip_special_tokens=False)

        tokens = [spelled(i) for i in ids]
        offsets, position = [], start_offset
        for text in tokens:
            offsets.append(position)
            position += len(text)
        top = [None if e is None else {spelled(t): lp for t, lp in e.top} for e in entries]
        return {"tokens": tokens, "token_logprobs": [None if e is None else e.logprob for e in entries],
                "top_logprobs": top, "text_offset": offsets}

    async def _stream_completions(self, streams: Streams, body: CompletionRequest, rid: str,
                                  created: int) -> AsyncIterator[str]:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        continuous = body.stream_options is not None and body.stream_options.continuous_usage_stats
        prompt_tokens: dict[int, int] = {}
        cached_tokens: dict[int, int] = {}
        completion_tokens: dict[tuple[int, int], int] = {}
        offsets: dict[tuple[int, int], int] = {}
        try:
            async for index, out in streams.merged():
                prompt_tokens[index] = len(out.prompt_token_ids)
                cached_tokens[index] = out.num_cached_tokens
                for comp in out.outputs:
                    key = (index, comp.index)
                    text = comp.delta_text
                    ids, entries = comp.delta_token_ids, []
                    if key not in offsets:  # the first chunk of a choice carries the echoed prompt
                        offsets[key] = 0
                        if body.echo:
                            text = self._prompt_text(out) + text
                            ids = out.prompt_token_ids + ids
                            entries = list(out.prompt_logprobs or [None] * len(out.prompt_token_ids))
                    if not text and not ids and not comp.finished:
                        continue
                    completion_tokens[key] = len(comp.token_ids)
                    lp = None
                    if body.logprobs is not None:
                        entries += (comp.logprobs or [])[len(comp.token_ids) - len(comp.delta_token_ids):]
                        lp = self._logprob_lists(ids, entries, offsets[key])
                    offsets[key] += len(text)
                    chunk = {"id": rid, "object": "text_completion", "created": created, "model": self.model_name,
                             "choices": [{"index": index * body.n + comp.index, "text": text, "logprobs": lp,
                                          "finish_reason": comp.finish_reason, "stop_reason": comp.stop_reason}]}
                    if continuous:
                        chunk["usage"] = usage(sum(prompt_tokens.values()), sum(completion_tokens.values()),
                                               sum(cached_tokens.values()))
                    yield sse(chunk)
            if include_usage:
                yield sse({"id": rid, "object": "text_completion", "created": created, "model": self.model_name,
                           "choices": [], "usage": usage(sum(prompt_tokens.values()),
                                                         sum(completion_tokens.values()),
                                                         sum(cached_tokens.values()))})
        except APIError as exc:
            yield sse({"error": {"message": exc.message, "type": "server_error", "param": None, "code": "503"}})
        yield sse("[DONE]")
