"""Send a workload to an OpenAI-compatible server and time every streamed token.

Requests leave at Poisson times (``request_rate`` a second; ``burstiness`` below 1 is burstier,
above 1 steadier: gamma-distributed gaps with that shape) or all at once (``inf``), at most
``max_concurrency`` in flight, until the workload or ``duration`` runs out. Each request is
streamed; its record keeps the send time, every content chunk's arrival, the output tokens the
server counted (``usage``) and, if it failed, the kind of failure. A failure is recorded,
never raised.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

import httpx

from duoserve.bench.workloads import BenchRequest


@dataclass
class RequestRecord:
    prompt_len: int
    output_len: int                 # asked for
    start: float = 0.0              # perf_counter at send
    chunk_times: list[float] = field(default_factory=list)  # arrivals of chunks with content
    end: float = 0.0
    output_tokens: int = 0          # the server's usage count (or the chunks, without usage)
    error: str | None = None        # kind: http_4xx, http_5xx, timeout, connection, stream
    text_parts: list[str] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.chunk_times)


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _body(request: BenchRequest, endpoint: str, model: str, ignore_eos: bool) -> dict:
    body = {"model": model, "max_tokens": request.output_len, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    if ignore_eos:
        body["ignore_eos"] = True
    if endpoint.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": request.prompt}]
    else:
        body["prompt"] = request.prompt
    return body


async def _send(client: httpx.AsyncClient, url: str, body: dict, record: RequestRecord) -> None:
    record.start = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body) as reply:
            if reply.status_code != 200:
                await reply.aread()
                record.error = f"http_{reply.status_code // 100}xx"
                return
            async for line in reply.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    record.error = "stream"
                    continue
                if chunk.get("usage"):
                    record.output_tokens = chunk["usage"].get("completion_tokens", 0)
                for choice in chunk.get("choices", []):
                    text = choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content")
                    if text:
                        record.chunk_times.append(time.perf_counter())
                        record.text_parts.append(text)
    except httpx.TimeoutException:
        record.error = "timeout"
    except httpx.HTTPError:
        record.error = "connection"
    except (ValueError, KeyError):
        record.error = "stream"
    finally:
        record.end = time.perf_counter()
        if not record.output_tokens:
            record.output_tokens = len(record.chunk_times)


async def run(base_url: str, endpoint: str, model: str | list[str], requests: list[BenchRequest], request_rate: float,
              burstiness: float = 1.0, max_concurrency: int | None = None, duration: float | None = None,
              ignore_eos: bool = False, api_key: str | None = None, seed: int = 0, timeout: float = 600.0,
              progress=None, extra_body: dict | list[dict] | None = None,
              headers: dict[str, str] | None = None) -> tuple[list[RequestRecord], float]:
    """Records of every request sent, and the seconds from the first send to the last answer
    (``extra_body``: fields added to every request's body, e.g. a priority; ``model``: several
    names are taken in turn, a request each, e.g. LoRA adapters; so are several extra bodies;
    ``headers``: sent with every request, e.g. llama-server's ``Connection: close``)."""
    rng = random.Random(seed)
    headers = {**auth_headers(api_key), **(headers or {})}
    limit = asyncio.Semaphore(max_concurrency or len(requests) or 1)
    records: list[RequestRecord] = []
    url = base_url.rstrip("/") + endpoint
    connections = httpx.Limits(max_connections=max_concurrency or None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=timeout, headers=headers, limits=connections) as client:
        models = [model] if isinstance(model, str) else model
        extras = extra_body if isinstance(extra_body, list) else [extra_body or {}]

        async def one(request: BenchRequest, record: RequestRecord, name: str, extra: dict) -> None:
            async with limit:
                await _send(client, url, {**_body(request, endpoint, name, ignore_eos), **extra}, record)
            if progress is not None:
                progress.update(1)

        start = time.perf_counter()
        tasks = []
        for request in requests:
            if duration is not None and time.perf_counter() - start >= duration:
                break
            record = RequestRecord(request.prompt_len, request.output_len)
            records.append(record)
            tasks.append(asyncio.create_task(one(request, record, models[len(tasks) % len(models)],
                                                 extras[len(tasks) % len(extras)])))
            if request_rate != float("inf"):
                # gamma gaps with mean 1/rate; shape = burstiness (1: Poisson arrivals)
                await asyncio.sleep(rng.gammavariate(burstiness, 1.0 / (request_rate * burstiness)))
        await asyncio.gather(*tasks)
        return records, time.perf_counter() - start
