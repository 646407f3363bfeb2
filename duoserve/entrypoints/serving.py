"""/v1/completions, and what every OpenAI surface shares: the served model's name checked.

The handler validates the body into SamplingParams (400 naming the parameter on a bad value),
starts one engine stream per prompt (``streams``), and either collects the streams into one JSON
response or forwards their deltas as server-sent events ending with ``data: [DONE]``. Only text
and numbers reach this module: no tensors.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from duoserve.entrypoints.errors import APIError
from duoserve.entrypoints.protocol import CompletionRequest
from duoserve.entrypoints.streams import Streams, checked_params, run_until_disconnect, sse, usage
from duoserve.frontend.async_engine import AsyncEngine
from duoserve.model.reranker import scores_only_reason
from duoserve.outputs import RequestOutput


class OpenAIServing:
    def __init__(self, engine: AsyncEngine, served_model_name: str) -> None:
        self.engine = engine
        self.model_name = served_model_name

    def check_model(self, model: str | None, generates: bool = True) -> None:
        """The model asked for is the one served (404 else), and it does what the route asks: a
        cross-encoder only scores (400 for a route that generates or embeds)."""
        if model is not None and model != self.model_name:
            raise APIError(404, f"The model `{model}` does not exist; this server serves `{self.model_name}`",
                           param="model", code="model_not_found")
        reason = scores_only_reason(self.engine.reranker) if generates else None
        if reason is not None:
            raise APIError(400, f"{self.model_name}: {reason}", param="model")

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
        params = checked_params(lambda: body.sampling_params(body.max_tokens, logprobs,
                                                      logprobs if body.echo and logprobs is not None else None))
        rid = f"cmpl-{uuid.uuid4().hex}"
        streams = Streams(self.engine, prompts, params, rid)
        await streams.start()
        created = int(time.time())
        if body.stream:
            return StreamingResponse(self._stream_completions(streams, body, rid, created),
                                     media_type="text/event-stream")
        finals = await run_until_disconnect(raw, streams.collect())
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
