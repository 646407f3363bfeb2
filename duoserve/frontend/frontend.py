"""The in-process frontend: prompts in, RequestOutputs out, over an ``EngineCore`` in this
process (the offline ``LLM``; the server's counterpart is ``AsyncEngine``).

``InputProcessor`` turns a prompt into the engine's ``Request``; each ``step`` runs the
engine once, and ``OutputProcessor`` turns its token deltas into text. ``Frontend`` is the
only one of the three that calls the engine: it adds and aborts requests, and passes on
what the output processor returns (samples ended on a stop string, finished requests).
"""

from __future__ import annotations

import itertools
from typing import Protocol

from duoserve.core.outputs import EngineCoreOutput
from duoserve.core.request import Request
from duoserve.frontend.input_processor import InputProcessor
from duoserve.frontend.output_processor import OutputProcessor, ProcessedOutputs, RequestState
from duoserve.model.tokenizer import Tokenizer
from duoserve.outputs import RequestOutput
from duoserve.sampling_params import SamplingParams


class EngineHandle(Protocol):
    """What a frontend asks of the engines behind it (``EngineCore``, or ``EngineGroup``)."""

    tokenizer: Tokenizer | None
    max_model_len: int
    reranker: str | None   # what kind of reranker the model is (LoadedModel.reranker), None for none

    @property
    def vocab_size(self) -> int: ...
    @property
    def eos_token_ids(self) -> tuple[int, ...]: ...
    def add_request(self, request: Request) -> None: ...
    def abort(self, request_id: str) -> object: ...
    def finish_stopped(self, request_id: str) -> None: ...
    def release(self, request_id: str) -> None: ...


class InProcessEngine(EngineHandle, Protocol):
    """An engine stepped by its caller (``EngineCore``)."""

    def step(self) -> list[EngineCoreOutput]: ...


def tell_engines(engine: EngineHandle, result: ProcessedOutputs) -> None:
    """Pass on what the output processor found: samples to stop, then requests to forget."""
    for request_id in result.stop_ids:
        engine.finish_stopped(request_id)
    for request_id in result.release_ids:
        engine.release(request_id)


class Frontend:
    def __init__(self, engine: InProcessEngine) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.inputs = InputProcessor(engine.tokenizer, engine.vocab_size, engine.eos_token_ids, engine.reranker)
        self.outputs = OutputProcessor()
        self._ids = itertools.count()

    @property
    def states(self) -> dict[str, RequestState]:
        return self.outputs.states

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def add_request(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                    strict_length: bool = False) -> str:
        text, prompt_ids = self.inputs.validate(prompt, params, self.max_model_len, strict_length)
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        self.outputs.check_unused(request_id)
        request, state = self.inputs.build(request_id, text, prompt_ids, params, self.max_model_len)
        self.engine.add_request(request)
        self.outputs.add_request(state)  # only once the engine took it: a refusal leaves nothing behind
        return request_id

    def abort(self, request_id: str) -> None:
        if request_id in self.outputs:
            self.engine.abort(request_id)
            self.outputs.abort(request_id)
            self.engine.release(request_id)

    def has_unfinished(self) -> bool:
        return self.outputs.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """Run one step of the engine; returns a snapshot of every request that moved."""
        return self.process_outputs(self.engine.step())

    def process_outputs(self, engine_outputs: list[EngineCoreOutput]) -> list[RequestOutput]:
        """Apply the engine's token deltas and tell it what they ended; one snapshot per request that moved."""
        result = self.outputs.process_outputs(engine_outputs)
        tell_engines(self.engine, result)
        return result.outputs
