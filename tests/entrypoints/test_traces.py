"""Request traces (``--otlp-traces-endpoint``): a real server exports one ``llm_request`` span per
request, with its GenAI attributes and its stages as child spans, to an OTLP/HTTP receiver run by
the test, colocated and disaggregated; with the flag off, OpenTelemetry is never imported."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from tests.server_helpers import Server


class Receiver:
    """An OTLP/HTTP trace receiver: every span posted to /v1/traces, decoded."""

    def __init__(self) -> None:
        self.spans: list = []
        spans = self.spans

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                for resource in request.resource_spans:
                    for scope in resource.scope_spans:
                        spans.extend(scope.spans)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def wait_for(self, name: str, count: int, guard: float = 60.0) -> list:
        deadline = time.monotonic() + guard
        while len([s for s in self.spans if s.name == name]) < count:
            assert time.monotonic() < deadline, f"{[s.name for s in self.spans]}"
            time.sleep(0.05)
        return [s for s in self.spans if s.name == name]

    def close(self) -> None:
        self.server.shutdown()


def attributes(span) -> dict:
    def value(v):
        kind = v.WhichOneof("value")
        return list(x.string_value for x in v.array_value.values) if kind == "array_value" else getattr(v, kind)
    return {a.key: value(a.value) for a in span.attributes}


@pytest.mark.parametrize("mode", ["colocated", "disaggregated"])
def test_each_request_is_one_trace_with_its_stages(tmp_path, mode):
    receiver = Receiver()
    srv = Server("--mode", mode, "--dtype", "float32", "--quantization", "none", "--kv-cache-memory", "0.1",
                 "--otlp-traces-endpoint", receiver.url, log=tmp_path / "server.log")
    try:
        for i in range(2):
            reply = httpx.post(f"{srv.url}/v1/completions", timeout=120,
                               json={"prompt": f"Trace number {i} goes", "max_tokens": 5, "ignore_eos": True,
                                     "temperature": 0.5, "user": "alice"})
            assert reply.status_code == 200
        requests = receiver.wait_for("llm_request", 2)
    finally:
        srv.stop()
        receiver.close()
    assert len({s.trace_id for s in requests}) == 2
    stages = ["queue", "prefill", "kv_handoff", "decode"] if mode == "disaggregated" else ["queue", "prefill", "decode"]
    for span in requests:
        children = sorted((s for s in receiver.spans if s.parent_span_id == span.span_id),
                          key=lambda s: s.start_time_unix_nano)
        assert [c.name for c in children] == stages
        assert all(c.trace_id == span.trace_id for c in children)
        assert span.start_time_unix_nano <= children[0].start_time_unix_nano
        assert children[-1].end_time_unix_nano <= span.end_time_unix_nano
        a = attributes(span)
        assert (a["gen_ai.request.model"], a["gen_ai.usage.output_tokens"], a["gen_ai.request.max_tokens"]) == \
            ("smollm2-135m", 5, 5)
        assert a["gen_ai.usage.input_tokens"] > 0 and a["gen_ai.request.temperature"] == 0.5
        assert 0 < a["gen_ai.latency.time_to_first_token"] <= a["gen_ai.latency.e2e"]
        assert a["duoserve.tenant"] == "alice" and a["gen_ai.response.finish_reasons"] == ["length"]


def test_with_the_flag_off_no_exporter_is_imported():
    """No span processor, exporter or SDK (the web framework may import OpenTelemetry's bare API
    for its own instrumentation; that costs nothing without an SDK)."""
    code = ("import sys\n"
            "from duoserve.config import EngineConfig\n"
            "from duoserve.entrypoints.api_server import create_app\n"
            "from duoserve.entrypoints.server_config import ServerConfig\n"
            "create_app(EngineConfig(), ServerConfig(served_model_name='m'))\n"
            "print(sorted(m for m in sys.modules if m.startswith(('opentelemetry.sdk', 'opentelemetry.exporter', "
            "'duoserve.tracing'))))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
