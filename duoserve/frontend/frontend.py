"""The frontend: prompts in, RequestOutputs out.

It tokenizes and validates each prompt, hands the engine a ``Request``, and turns the
engine's token deltas into text (incremental detokenization, stop strings), samples of
an ``n > 1`` prompt gathered under their prompt's id.

The engine is anything with the ``EngineHandle`` methods: an ``EngineCore`` in this
process (offline use) or a client of an engine in another process (the server).
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from dataclasses import dataclass, field
from typing import Protocol

from duoserve.core.outputs import EngineCoreOutput, TokenLogprobs
from duoserve.core.request import Request
from duoserve.errors import InvalidInputError
from duoserve.frontend.detokenizer import IncrementalDetokenizer
from duoserve.model.tokenizer import Tokenizer
from duoserve.outputs import CompletionOutput, RequestOutput
from duoserve.sampling_params import SamplingParams


class EngineHandle(Protocol):
    tokenizer: Tokenizer | None
    max_model_len: int

    @property
    def vocab_size(self) -> int: ...
    @property
    def eos_token_ids(self) -> tuple[int, ...]: ...
    def add_request(self, request: Request) -> None: ...
    def abort(self, request_id: str) -> object: ...
    def finish_stopped(self, request_id: str) -> None: ...
    def release(self, request_id: str) -> None: ...


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    outputs: list[CompletionOutput]
    detokenizers: list[IncrementalDetokenizer | None]
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    prompt_logprobs_done: bool = False  # they come whole, once; after a handoff both engines send them
    num_cached_tokens: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    stage_seconds: dict[str, float] = field(default_factory=dict)  # TTFT stages reported by the engine

    def snapshot(self) -> RequestOutput:
        """A copy of the request's state, carrying each sample's delta since the last snapshot."""
        metrics = {"arrival_time": self.arrival_time}
        if self.first_token_time is not None:
            metrics["first_token_time"] = self.first_token_time
        metrics.update({f"{stage}_seconds": value for stage, value in self.stage_seconds.items()})
        outputs = []
        for output in self.outputs:
            outputs.append(dataclasses.replace(
                output, token_ids=list(output.token_ids),
                logprobs=None if output.logprobs is None else list(output.logprobs),
                delta_token_ids=list(output.delta_token_ids)))
            output.delta_text, output.delta_token_ids = "", []
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, outputs,
                             None if self.prompt_logprobs is None else list(self.prompt_logprobs),
                             self.num_cached_tokens, metrics)


class Frontend:
    def __init__(self, engine: EngineHandle) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.states: dict[str, RequestState] = {}
        self._ids = itertools.count()

    def tokenize_prompt(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidInputError("prompt", "this model has no tokenizer: send token ids instead of text")
            ids = self.tokenizer.encode(prompt)
            if not ids:   # "" (OpenAI's API allows it): the model starts a new document
                start = self.tokenizer.bos_token_id
                ids = [start if start is not None else self.engine.eos_token_ids[0]]
            return prompt, ids
        ids = list(prompt)
        vocab = self.engine.vocab_size
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise InvalidInputError("prompt", f"token id {bad[0]!r} is out of range: ids are integers in [0, {vocab})")
        return None, ids

    def check_length(self, prompt_ids: list[int], params: SamplingParams, strict: bool) -> None:
        """Refuse an empty prompt, or one with no room for a token; ``strict`` also counts max_tokens."""
        if not prompt_ids:
            raise InvalidInputError("prompt", "the prompt is empty: give at least one token")
        num = len(prompt_ids)
        if num >= self.max_model_len:
            raise InvalidInputError(
                "prompt", f"the prompt has {num} tokens, but the context length (max_model_len) is "
                          f"{self.max_model_len}: at most {self.max_model_len - 1} prompt tokens fit")
        if strict and params.max_tokens is not None and num + params.max_tokens > self.max_model_len:
            raise InvalidInputError(
                "max_tokens", f"this model's context length is {self.max_model_len} tokens, but the request "
                              f"asks for {num + params.max_tokens} ({num} in the prompt + {params.max_tokens} "
                              "max_tokens); lower max_tokens or shorten the prompt")

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len  # an engine group lowers it when a smaller engine joins

    def add_request(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                    strict_length: bool = False) -> str:
        text, prompt_ids = self.tokenize_prompt(prompt)
        self.check_length(prompt_ids, params, strict_length)
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.states:
            raise InvalidInputError("request_id", f"request id {request_id!r} is already in use")
        detokenizers = [
            IncrementalDetokenizer(self.tokenizer, prompt_ids, params.stop, params.skip_special_tokens,
                                   params.include_stop_str_in_output) if self.tokenizer else None
            for _ in range(params.n)]
        state = RequestState(request_id, text, prompt_ids, params,
                             [CompletionOutput(i) for i in range(params.n)], detokenizers,
                             [None] if params.prompt_logprobs is not None else None)
        for output in state.outputs:
            output.logprobs = [] if params.logprobs is not None else None
        max_total = self.max_model_len
        if params.max_tokens is not None:
            max_total = min(max_total, len(prompt_ids) + params.max_tokens)
        self.engine.add_request(Request(request_id, prompt_ids, params, self.engine.eos_token_ids, max_total))
        self.states[request_id] = state  # only once the engine took it: a refusal leaves nothing behind
        return request_id

    def abort(self, request_id: str) -> None:
        if request_id in self.states:
            self.engine.abort(request_id)
            for output in self.states[request_id].outputs:
                if not output.finished:
                    output.finish_reason = "abort"
            self._release(request_id)

    def has_unfinished(self) -> bool:
        return bool(self.states)

    def step(self) -> list[RequestOutput]:
        """Run one step of an in-process engine; returns a snapshot of every request that moved."""
        return self.process_outputs(self.engine.step())

    def process_outputs(self, engine_outputs: list[EngineCoreOutput]) -> list[RequestOutput]:
        """Apply the engine's token deltas; one snapshot per request that moved."""
        touched: dict[str, RequestState] = {}
        for out in engine_outputs:
            found = self._locate(out.request_id)
            if found is None:
                continue
            state, index = found
            self._apply(state, index, out)
            touched[state.request_id] = state
        results = []
        for request_id, state in touched.items():
            results.append(state.snapshot())
            if all(o.finished for o in state.outputs):
                self._release(request_id)
        return results

    def _locate(self, engine_id: str) -> tuple[RequestState, int] | None:
        if engine_id in self.states:
            return self.states[engine_id], 0
        parent, _, index = engine_id.rpartition("/")
        state = self.states.get(parent)
        return (state, int(index)) if state is not None and index.isdigit() else None

    def _apply(self, state: RequestState, index: int, out: EngineCoreOutput) -> None:
        completion = state.outputs[index]
        if out.prompt_logprobs is not None and state.prompt_logprobs is not None and not state.prompt_logprobs_done:
            state.prompt_logprobs.extend(out.prompt_logprobs)
            state.prompt_logprobs_done = True
        if completion.finished:
            return
        already = len(completion.token_ids) - out.position  # tokens of this output seen before
        if already > 0:
            out.new_token_ids = out.new_token_ids[already:]
            if out.new_logprobs:
                out.new_logprobs = out.new_logprobs[already:]
        if out.new_token_ids and state.first_token_time is None:
            state.first_token_time = time.monotonic()
        state.num_cached_tokens = out.num_cached_tokens
        if out.stages:
            state.stage_seconds.update(out.stages)
        detok = state.detokenizers[index]
        stop_hit = detok.add_tokens(out.new_token_ids) if detok is not None else None
        if stop_hit is not None:  # tokens after the one that completed the stop string are not output
            out.new_token_ids = out.new_token_ids[:detok.num_used]
            out.new_logprobs = out.new_logprobs[:detok.num_used] if out.new_logprobs else out.new_logprobs
        completion.token_ids.extend(out.new_token_ids)
        if out.new_logprobs and completion.logprobs is not None:
            completion.logprobs.extend(out.new_logprobs)
        completion.delta_token_ids.extend(out.new_token_ids)
        if stop_hit is not None:
            if not out.finished:
                self.engine.finish_stopped(out.request_id)
            completion.finish_reason, completion.stop_reason = "stop", stop_hit
        elif out.finished:
            completion.finish_reason, completion.stop_reason = out.finish_reason, out.stop_reason
            completion.error = out.error
        if detok is not None:
            completion.text = detok.text
            completion.delta_text += detok.take_delta(completion.finished)

    def _release(self, request_id: str) -> None:
        self.states.pop(request_id, None)
        self.engine.release(request_id)
