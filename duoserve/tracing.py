"""Request traces as OpenTelemetry spans (``--otlp-traces-endpoint URL``), off by default.

Each finished request is one span, ``llm_request`` (vLLM's name), from its arrival to its last
token, with OpenTelemetry's GenAI attributes (``gen_ai.request.model``, ``gen_ai.usage.input_tokens``
and ``output_tokens``, the request's sampling settings) and vLLM's latency ones
(``gen_ai.latency.time_to_first_token``, ``time_in_queue``, ``e2e``), and a child span for each
stage of its life: ``queue`` and ``prefill`` (measured by the engine that computed the prompt),
``kv_handoff`` (disaggregated: the transfer to the decode engine and its admission there), and
``decode`` (its first token to its last). The stages' lengths come from the engines; the frontend
lays them end to end from the request's arrival, so one trace covers every engine a request
crossed. Spans leave in batches from a background thread (OTLP over HTTP, protobuf).

With the flag off nothing here runs and OpenTelemetry is not imported.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from duoserve.outputs import RequestOutput

EXPORT_DELAY_MS = 500   # how long a finished span may wait for its batch


def monotonic_to_ns(mono: float) -> int:
    """A ``time.monotonic()`` reading as wall-clock nanoseconds (what spans carry)."""
    return time.time_ns() - int((time.monotonic() - mono) * 1e9)


class RequestTracer:
    def __init__(self, endpoint: str, model: str, request_class: Callable[[str], Any]) -> None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        self.provider = TracerProvider(resource=Resource.create({"service.name": "duoserve"}))
        self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint),
                                                            schedule_delay_millis=EXPORT_DELAY_MS))
        self.tracer = self.provider.get_tracer("duoserve")
        self.model = model
        self.request_class = request_class   # request id -> its class (.params, .tenant, .priority)
        self.stages: dict[str, dict[str, float]] = {}   # request id -> stage seconds seen so far

    def observe_output(self, out: RequestOutput) -> None:
        seen = self.stages.setdefault(out.request_id, {})
        for name, value in out.metrics.items():
            if name.endswith("_seconds"):
                seen[name[:-len("_seconds")]] = value
        if out.finished:
            self._span(out, self.stages.pop(out.request_id))

    def _span(self, out: RequestOutput, stages: dict[str, float]) -> None:
        from opentelemetry.trace import SpanKind

        end = time.time_ns()
        arrival = monotonic_to_ns(out.metrics.get("arrival_time", time.monotonic()))
        first = out.metrics.get("first_token_time")
        first_ns = monotonic_to_ns(first) if first is not None else None
        span = self.tracer.start_span("llm_request", kind=SpanKind.SERVER, start_time=arrival,
                                      attributes=self._attributes(out, stages, arrival, first_ns, end))
        context = _context_of(span)
        at = arrival
        for stage, name in (("queue", "queue"), ("prefill", "prefill"), ("transfer", "kv_handoff")):
            length = stages.get(stage, 0.0) + (stages.get("admit", 0.0) if stage == "transfer" else 0.0)
            if stage in stages:
                child_end = at + int(length * 1e9)
                self.tracer.start_span(name, context=context, start_time=at).end(end_time=child_end)
                at = child_end
        if first_ns is not None:
            self.tracer.start_span("decode", context=context, start_time=max(first_ns, at)).end(end_time=end)
        span.end(end_time=end)

    def _attributes(self, out: RequestOutput, stages: dict[str, float], arrival: int, first_ns: int | None,
                    end: int) -> dict:
        attributes = {"gen_ai.operation.name": "text_completion", "gen_ai.system": "duoserve",
                      "gen_ai.request.model": self.model, "gen_ai.response.model": self.model,
                      "gen_ai.response.id": out.request_id,
                      "gen_ai.usage.input_tokens": len(out.prompt_token_ids),
                      "gen_ai.usage.output_tokens": sum(len(o.token_ids) for o in out.outputs),
                      "gen_ai.response.finish_reasons": [o.finish_reason or "" for o in out.outputs],
                      "gen_ai.latency.e2e": (end - arrival) / 1e9,
                      "gen_ai.latency.time_in_queue": stages.get("queue", 0.0)}
        if first_ns is not None:
            attributes["gen_ai.latency.time_to_first_token"] = (first_ns - arrival) / 1e9
        cls = self.request_class(out.request_id)
        if cls is not None:
            params = cls.params
            attributes.update({"gen_ai.request.max_tokens": params.max_tokens or 0,
                               "gen_ai.request.temperature": params.temperature,
                               "gen_ai.request.top_p": params.top_p, "gen_ai.request.n": params.n,
                               "duoserve.tenant": cls.label, "duoserve.priority": cls.priority})
        return attributes

    def shutdown(self) -> None:
        self.provider.shutdown()   # what is still batched goes out first


def _context_of(span):
    from opentelemetry import trace

    return trace.set_span_in_context(span)
