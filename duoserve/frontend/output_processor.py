"""Output processing: the engines' token deltas in, RequestOutputs out.

The ``OutputProcessor`` keeps each request's ``RequestState`` (its samples' tokens, text,
logprobs and timings) from the moment an engine took the request until its last sample
finished. ``process_outputs`` applies a batch of ``EngineCoreOutput`` (incremental
detokenization, stop strings, the samples of an ``n > 1`` request gathered under their
prompt's id) and returns a ``ProcessedOutputs``: one snapshot per request that moved, and
what the engines must now be told. It never calls an engine itself (vLLM's rule: the
output processor returns what to abort); the one object that talks to the engines
(``Frontend`` in-process, ``AsyncEngine`` in the server) tells them.

Request lifecycle as seen here::

    add_request(state)
      |-- process_outputs() ... every sample finished --> in release_ids, forgotten here
      |-- abort(request_id) --> forgotten here; the caller aborts and releases it in the engines
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

from duoserve.core.outputs import EngineCoreOutput, TokenLogprobs
from duoserve.errors import InvalidInputError
from duoserve.frontend.detokenizer import IncrementalDetokenizer
from duoserve.outputs import CompletionOutput, RequestOutput
from duoserve.sampling_params import SamplingParams


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
    pooled: list[float] | None = None   # an embedding, with the request's finish

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
                             self.num_cached_tokens, metrics, self.pooled)

    @property
    def finished(self) -> bool:
        return all(o.finished for o in self.outputs)


@dataclass(slots=True)
class ProcessedOutputs:
    """What one batch of engine outputs came to; the caller passes the ids on to the engines."""

    # one snapshot per request that moved, in the order the batch first named it
    outputs: list[RequestOutput] = field(default_factory=list)
    # engine ids ("req" or "req/1") of samples that ended on a stop string found here while the
    # engine still runs them: the engines finish them (``finish_stopped``)
    stop_ids: list[str] = field(default_factory=list)
    # requests whose every sample has finished, forgotten here: the engines drop them (``release``)
    release_ids: list[str] = field(default_factory=list)


class OutputProcessor:
    def __init__(self) -> None:
        self.states: dict[str, RequestState] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.states

    def __len__(self) -> int:
        return len(self.states)

    def has_unfinished(self) -> bool:
        return bool(self.states)

    def check_unused(self, request_id: str) -> None:
        if request_id in self.states:
            raise InvalidInputError("request_id", f"request id {request_id!r} is already in use")

    def add_request(self, state: RequestState) -> None:
        """Track a request an engine has taken (its id checked with ``check_unused`` first)."""
        assert state.request_id not in self.states, f"request {state.request_id!r} is tracked already"
        self.states[state.request_id] = state

    def abort(self, request_id: str) -> bool:
        """Mark the unfinished samples aborted and forget the request; False if it is not tracked."""
        state = self.states.pop(request_id, None)
        if state is None:
            return False
        for output in state.outputs:
            if not output.finished:
                output.finish_reason = "abort"
        return True

    def process_outputs(self, engine_outputs: list[EngineCoreOutput]) -> ProcessedOutputs:
        """Apply the engines' token deltas; outputs of requests no longer tracked are dropped."""
        result = ProcessedOutputs()
        touched: dict[str, RequestState] = {}
        for out in engine_outputs:
            found = self._locate(out.request_id)
            if found is None:
                continue
            state, index = found
            if _apply(state, index, out):
                result.stop_ids.append(out.request_id)
            touched[state.request_id] = state
        for request_id, state in touched.items():
            result.outputs.append(state.snapshot())
            if state.finished:
                del self.states[request_id]
                result.release_ids.append(request_id)
        return result

    def _locate(self, engine_id: str) -> tuple[RequestState, int] | None:
        if engine_id in self.states:
            return self.states[engine_id], 0
        parent, _, index = engine_id.rpartition("/")
        state = self.states.get(parent)
        return (state, int(index)) if state is not None and index.isdigit() else None


def _apply(state: RequestState, index: int, out: EngineCoreOutput) -> bool:
    """Apply one sample's delta; True when a stop string ended it while the engine still runs it."""
    completion = state.outputs[index]
    if out.prompt_logprobs is not None and state.prompt_logprobs is not None and not state.prompt_logprobs_done:
        state.prompt_logprobs.extend(out.prompt_logprobs)
        state.prompt_logprobs_done = True
    if completion.finished:
        return False
    already = len(completion.token_ids) - out.position  # tokens of this output seen before
    if already > 0:
        out.new_token_ids = out.new_token_ids[already:]
        if out.new_logprobs:
            out.new_logprobs = out.new_logprobs[already:]
    if out.new_token_ids and state.first_token_time is None:
        state.first_token_time = time.monotonic()
    state.num_cached_tokens = out.num_cached_tokens
    if out.pooled is not None:
        state.pooled = out.pooled
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
        completion.finish_reason, completion.stop_reason = "stop", stop_hit
    elif out.finished:
        completion.finish_reason, completion.stop_reason = out.finish_reason, out.stop_reason
        completion.error = out.error
    if detok is not None:
        completion.text = detok.text
        completion.delta_text += detok.take_delta(completion.finished)
    return stop_hit is not None and not out.finished
