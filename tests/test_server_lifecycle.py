"""Server lifecycle: graceful SIGTERM, no child left behind, a dead engine reported, not hung on."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx

from tests.server_helpers import Server, alive, children, engine_children


def test_sigterm_drains_in_flight_request_and_leaves_no_child(tmp_path):
    """The request in flight when SIGTERM arrives still completes; then the engine child is gone."""
    srv = Server("--kv-cache-memory", "0.2", "--max-model-len", "4096", "--shutdown-timeout", "20", log=tmp_path / "log")
    engine_pids = engine_children(srv.proc.pid)
    all_children = children(srv.proc.pid)
    assert len(engine_pids) == 1, "the engine runs in a child process"
    maps = open(f"/proc/{srv.proc.pid}/maps").read()
    assert "libtorch" not in maps, "the API process must not load torch (it would cost ~250 MB)"
    result = {}

    def request() -> None:
        body = {"prompt": "Once upon a time", "max_tokens": 40, "ignore_eos": True}
        result["response"] = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60)

    thread = threading.Thread(target=request)
    thread.start()
    time.sleep(1.0)
    # uvicorn drains, shuts the app down, then re-raises the signal: exit by SIGTERM is a clean stop
    assert srv.stop(signal.SIGTERM) in (0, -signal.SIGTERM)
    thread.join(30)
    assert result["response"].status_code == 200
    assert result["response"].json()["usage"]["completion_tokens"] == 40
    deadline = time.monotonic() + 10
    while any(alive(p) for p in all_children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(p) for p in all_children)


def test_dead_engine_fails_requests_and_health_then_is_relaunched(tmp_path):
    srv = Server("--kv-cache-memory", "0.2", "--max-model-len", "4096", log=tmp_path / "log")
    try:
        (engine_pid,) = engine_children(srv.proc.pid)
        lines: list[str] = []
        body = {"prompt": "Tell me a long story", "max_tokens": 3000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line:
                    lines.append(line)
                if len(lines) == 3:
                    os.kill(engine_pid, signal.SIGKILL)
        assert lines[-1] == "data: [DONE]"
        error = json.loads([ln for ln in lines if ln.startswith("data: {\"error\"")][0][6:])["error"]
        assert "engine" in error["message"]
        health = httpx.get(f"{srv.url}/health", timeout=10)
        assert health.status_code == 503 and "engine-0" in health.json()["reason"]
        refused = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "x"}, timeout=10)
        assert refused.status_code == 503 and refused.json()["error"]["type"] == "service_unavailable"
        models = httpx.get(f"{srv.url}/v1/models", timeout=10)  # what the frontend knows stays served
        assert models.status_code == 200 and models.json()["data"][0]["max_model_len"] == 4096
        deadline = time.monotonic() + 60  # the launcher relaunches the engine; then it serves again
        while httpx.get(f"{srv.url}/health", timeout=10).status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.2)
        (relaunched,) = engine_children(srv.proc.pid)
        assert relaunched != engine_pid
        again = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "x", "max_tokens": 3}, timeout=30)
        assert again.status_code == 200 and again.json()["usage"]["completion_tokens"] == 3
    finally:
        assert srv.stop(signal.SIGINT) in (0, -signal.SIGINT)
