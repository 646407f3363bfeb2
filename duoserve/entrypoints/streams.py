"""The plumbing every API surface shares: a request's engine streams (one per prompt) started,
merged and collected (``Streams``), cancelled when the client leaves (``run_until_disconnect``),
and the pieces of OpenAI's wire format the surfaces reuse (``sse``, ``usage``). Engine errors
become HTTP errors here: a refused input 400, a full queue 429, an engine away or a request
that waited past its timeout 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

from fastapi import Request

from duoserve.entrypoints.errors import APIError
from duoserve.entrypoints.tenants import with_tenant
from duoserve.errors import ConfigError, InvalidInputError, ModelLoadError
from duoserve.frontend.admission import QueueFullError, QueueTimeoutError
from duoserve.frontend.async_engine import AsyncEngine, EngineUnavailableError
from duoserve.frontend.engine_client import EngineDeadError
from duoserve.outputs import RequestOutput
from duoserve.sampling_params import SamplingParams


def checked_params(build) -> SamplingParams:
    """``build()``'s sampling parameters; a value they refuse is a 400 naming its field."""
    try:
        return build()
    except ConfigError as exc:
        raise APIError(400, str(exc), param=exc.field) from exc


async def first_output(stream: AsyncIterator[RequestOutput], prompt_param: str = "prompt") -> RequestOutput:
    """Start a stream, mapping input errors found at its start to HTTP errors (a prompt problem
    names ``prompt_param``: the chat route's prompt comes from ``messages``)."""
    try:
        return await stream.__anext__()
    except InvalidInputError as exc:
        raise APIError(400, str(exc), param=prompt_param if exc.param == "prompt" else exc.param) from exc
    except QueueFullError as exc:
        raise APIError(429, str(exc), headers={"Retry-After": str(exc.retry_after)}) from exc
    except QueueTimeoutError as exc:
        raise APIError(503, str(exc), param="timeout", code="queue_timeout",
                       headers={"Retry-After": str(exc.retry_after)}) from exc
    except (EngineUnavailableError, EngineDeadError, ModelLoadError) as exc:
        raise APIError(503, f"the engine is unavailable: {exc}") from exc


class Streams:
    """Several engine streams (one per prompt) merged into one, for a single HTTP request."""

    def __init__(self, engine: AsyncEngine, prompts: list, params: SamplingParams, base_id: str,
                 prompt_param: str = "prompt") -> None:
        self.engine, self.base_id = engine, base_id
        params = with_tenant(params)
        self.streams = [engine.generate(p, params, f"{base_id}-{i}") for i, p in enumerate(prompts)]
        self.firsts: list[RequestOutput] = []
        self.prompt_param = prompt_param

    async def start(self) -> None:
        """Every stream's first output. The streams start together (each prompt is admitted before
        any is awaited), so their prompts share the engine's steps; a prompt refused ends them all."""
        tasks = [asyncio.ensure_future(first_output(stream, self.prompt_param)) for stream in self.streams]
        try:
            await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:
                task.cancel()
            try:
                await asyncio.gather(*tasks, return_exceptions=True)
            finally:   # cancelled again meanwhile (a shutdown): the streams are closed all the same
                await self.close()
            raise
        self.firsts = [task.result() for task in tasks]

    async def start_and_collect(self) -> list[RequestOutput]:
        """Each prompt's final output, in the prompts' order, from the start."""
        await self.start()
        return await self.collect()

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

    async def collect(self) -> list[RequestOutput]:
        """Each prompt's final output, in the prompts' order."""
        finals: list[RequestOutput | None] = [None] * len(self.streams)
        async for index, out in self.merged():
            finals[index] = out
        return finals

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
