"""Grammars compiled off the step loop, and each sample's matcher kept in step with its outputs.

A grammar compiles once per distinct spec, on one background thread (llguidance drops the GIL
while it builds), so the engine keeps stepping: the scheduler admits a constrained request
once its grammar is ready (``ready``). A sample's matcher is the compiled grammar's copy
advanced by the sample's output tokens, made on first use and kept on the request
(``Request.grammar``): a preempted or swapped request keeps it, a new sample of an n > 1
prompt or a request handed over by a prefill engine (its first token already drawn there)
gets its own, advanced by the tokens it already has.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

import llguidance

from duoserve.core.request import Request
from duoserve.sampling_params import StructuredOutputsParams
from duoserve.structured.grammar import GrammarCompiler, GrammarError

logger = logging.getLogger(__name__)

MAX_CACHED_GRAMMARS = 256


class SampleMatcher:
    """One sample's matcher and how many of its output tokens it has consumed."""

    __slots__ = ("matcher", "num_consumed")

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher = matcher
        self.num_consumed = 0


class GrammarCache:
    def __init__(self, compiler: GrammarCompiler) -> None:
        self.compiler = compiler
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        self._compiled: OrderedDict[tuple, Future] = OrderedDict()
        self.num_compiled = 0
        self.num_failed = 0
        self.compile_seconds = 0.0

    def _future(self, spec: StructuredOutputsParams) -> Future:
        key = spec.key
        future = self._compiled.get(key)
        if future is None:
            future = self._compiled[key] = self._pool.submit(self._compile, spec)
            while len(self._compiled) > MAX_CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(key)
        return future

    def _compile(self, spec: StructuredOutputsParams) -> llguidance.LLMatcher | GrammarError:
        start = time.perf_counter()
        try:
            matcher = self.compiler.compile(spec)
        except GrammarError as exc:
            self.num_failed += 1
            logger.warning("a %s cannot be enforced: %s", spec.kind, exc)
            return exc
        finally:
            self.compile_seconds += time.perf_counter() - start
        self.num_compiled += 1
        return matcher

    def ready(self, request: Request) -> bool:
        """Whether the request's grammar is compiled (or it has none); the first ask starts it."""
        spec = request.params.structured_outputs
        return spec is None or request.grammar is not None or self._future(spec).done()

    @property
    def compiling(self) -> bool:
        return any(not future.done() for future in self._compiled.values())

    def wait(self, timeout: float) -> None:
        """Block until some grammar being compiled is done, at most ``timeout`` seconds (the
        engine has nothing else to do)."""
        pending = [future for future in self._compiled.values() if not future.done()]
        if pending:
            wait(pending, timeout=timeout, return_when=FIRST_COMPLETED)

    def matcher(self, request: Request) -> llguidance.LLMatcher:
        """The request's matcher, having consumed every output token it has; raises GrammarError
        when its grammar failed to compile or an output token breaks it."""
        state = request.grammar
        if state is None:
            template = self._future(request.params.structured_outputs).result()
            if isinstance(template, GrammarError):
                raise template
            state = request.grammar = SampleMatcher(template.deep_copy())
        pending = request.output_token_ids[state.num_consumed:]
        if pending:
            if not state.matcher.consume_tokens(pending):
                raise GrammarError(f"output token outside the grammar: {state.matcher.get_error()}")
            state.num_consumed += len(pending)
        return state.matcher

    def stats(self) -> dict:
        return {"grammars_compiled": self.num_compiled, "grammars_failed": self.num_failed,
                "grammar_compile_seconds": self.compile_seconds}

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
