"""Server lifecycle: graceful SIGTERM, no child left behind, a dead engine reported, not hung on."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

from tests.server_helpers import Server, alive, descendants, engine_children, metric, wait_gauges_idle, wait_metric

BAD_LOG_LINES = ("Traceback", "CancelledError", "KeyboardInterrupt", "relaunched", "a metrics hook failed")


def test_sigterm_drains_in_flight_request_and_leaves_no_child(tmp_path):
    """The request in flight when SIGTERM arrives still completes; then the engine child is gone."""
    srv = Server("--kv-cache-memory", "0.2", "--max-model-len", "4096", "--shutdown-timeout", "20", log=tmp_path / "log")
    engine_pids = engine_children(srv.proc.pid)
    all_children = descendants(srv.proc.pid)
    assert len(engine_pids) == 1, "the engine runs in a child process"
    maps = open(f"/proc/{srv.proc.pid}/maps").read()
    assert "libtorch" not in maps, "the API process must not load torch (it would cost ~250 MB)"
    assert "_raylet" not in maps, "without --cluster ray, Ray is not imported"
    lines: list[str] = []
    body = {"prompt": "Once upon a time", "max_tokens": 40, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    thread = threading.Thread(target=_stream, args=(srv.url, body, lines))
    thread.start()
    _wait_for(lambda: lines, 600)   # in flight once its first token came back, however loaded the machine
    # uvicorn drains, shuts the app down, then re-raises the signal: exit by SIGTERM is a clean stop
    assert srv.stop(signal.SIGTERM) in (0, -signal.SIGTERM)
    thread.join(600)
    assert lines[-1] == "data: [DONE]"
    usage = json.loads(lines[-2].removeprefix("data: "))["usage"]
    assert usage["completion_tokens"] == 40
    deadline = time.monotonic() + 10
    while any(alive(p) for p in all_children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(p) for p in all_children)


def _stream(url: str, body: dict, lines: list, timeout: float = 120) -> None:
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=timeout) as r:
        for line in r.iter_lines():
            if line:
                lines.append(line)


def _wait_for(predicate, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_ctrl_c_to_the_process_group_drains_then_ends_late_streams_cleanly(tmp_path):
    """A terminal's Ctrl-C reaches the engine too; it leaves stopping to the server, which drains:
    a short stream completes, a stream that outlasts --shutdown-timeout gets a final error
    event and [DONE]; no traceback, nothing relaunched, exit 0, no child left."""
    log = tmp_path / "log"
    srv = Server("--kv-cache-memory", "0.2", "--max-model-len", "4096", "--shutdown-timeout", "4", log=log,
                 new_session=True)
    all_children = descendants(srv.proc.pid)
    short, long = [], []
    threads = [threading.Thread(target=_stream, args=(srv.url, {"prompt": "Hi", "max_tokens": 40, "ignore_eos": True}, short)),
               threading.Thread(target=_stream, args=(srv.url, {"prompt": "Go", "max_tokens": 3000, "ignore_eos": True}, long))]
    for t in threads:
        t.start()
    _wait_for(lambda: len(short) >= 2 and len(long) >= 2, 30)
    os.killpg(srv.proc.pid, signal.SIGINT)
    for t in threads:
        t.join(60)
    assert srv.proc.wait(60) == 0
    text = log.read_text()
    assert not [bad for bad in BAD_LOG_LINES if bad in text], text[-3000:]
    assert short[-1] == "data: [DONE]" and len(short) == 40 + 1, "the in-flight request finished"
    assert long[-1] == "data: [DONE]"
    error = json.loads(long[-2][6:])["error"]
    assert "the server is shutting down" in error["message"] and error["code"] == "503"
    _wait_for(lambda: not any(alive(p) for p in all_children), 10)


def test_a_dead_engine_is_relaunched_and_its_stream_goes_on_there(tmp_path):
    """After traffic, kill -9 the only engine mid-stream: while it is down /health says so and
    new requests are refused, the stream waits; the engine is relaunched, the stream goes on
    there with the tokens an undisturbed run gives, and every counter keeps counting up from
    where it was."""
    log = tmp_path / "log"
    srv = Server("--kv-cache-memory", "0.2", "--max-model-len", "4096", log=log)
    try:
        (engine_pid,) = engine_children(srv.proc.pid)
        for i in range(3):  # traffic the old engine counts (prefix-cache lookups, tokens)
            r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": f"Count to {i} " * 20, "max_tokens": 4},
                           timeout=120)   # a hang guard: httpx's 5 s default failed it on a busy machine
            assert r.status_code == 200
        body = {"prompt": "Tell me a long story", "max_tokens": 48, "ignore_eos": True, "temperature": 0}
        want = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
        wait_metric(srv.url, "duoserve:prefix_cache_queries_total", lambda v: v > 100)   # the engine's stats came
        counters = ["duoserve:prefix_cache_queries_total", "duoserve:generation_tokens_total",
                    "duoserve:prompt_tokens_total"]
        before = {name: metric(srv.url, name) for name in counters}
        assert before["duoserve:prefix_cache_queries_total"] > 100
        lines: list[str] = []
        while_down = {}
        with httpx.stream("POST", f"{srv.url}/v1/completions", json={**body, "stream": True}, timeout=120) as r:
            for line in r.iter_lines():
                if line:
                    lines.append(line)
                if len(lines) == 3 and not while_down:
                    os.kill(engine_pid, signal.SIGKILL)
                    _wait_for(lambda: httpx.get(f"{srv.url}/health", timeout=10).status_code == 503, 10)
                    while_down["health"] = httpx.get(f"{srv.url}/health", timeout=10).json()
                    while_down["new"] = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "x"}, timeout=10)
                    while_down["models"] = httpx.get(f"{srv.url}/v1/models", timeout=10)
        assert lines[-1] == "data: [DONE]"
        assert not [ln for ln in lines if "error" in ln], "the stream saw no error"
        text = "".join(json.loads(ln[6:])["choices"][0]["text"] for ln in lines[:-1])
        assert text == want, "the stream went on where it was, as if nothing had happened"
        assert "engine-0" in while_down["health"]["reason"]
        refused = while_down["new"]
        assert refused.status_code == 503 and refused.json()["error"]["type"] == "service_unavailable"
        models = while_down["models"]  # what the frontend knows stays served
        assert models.status_code == 200 and models.json()["data"][0]["max_model_len"] == 4096
        assert metric(srv.url, "duoserve:request_migrations_total", {"cause": "exited"}) == 1
        wait_gauges_idle(srv.url, within=120)   # a hang guard
        deadline = time.monotonic() + 60  # the launcher relaunches the engine; then it serves again
        while httpx.get(f"{srv.url}/health", timeout=10).status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.2)
        (relaunched,) = engine_children(srv.proc.pid)
        assert relaunched != engine_pid
        for _ in range(2):
            again = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "x y", "max_tokens": 3}, timeout=30)
            assert again.status_code == 200 and again.json()["usage"]["completion_tokens"] == 3
        wait_metric(srv.url, "duoserve:prefix_cache_queries_total",
                    lambda v: v > before["duoserve:prefix_cache_queries_total"])   # the new engine's stats came
        after = {name: metric(srv.url, name) for name in counters}
        assert after["duoserve:prefix_cache_queries_total"] > before["duoserve:prefix_cache_queries_total"]
        assert after["duoserve:generation_tokens_total"] >= before["duoserve:generation_tokens_total"] + 6
        assert after["duoserve:prompt_tokens_total"] > before["duoserve:prompt_tokens_total"]
        wait_gauges_idle(srv.url, within=120)
        assert httpx.get(f"{srv.url}/health", timeout=10).status_code == 200, "still serving"
    finally:
        assert srv.stop(signal.SIGINT) == 0
    assert "Counters can only be incremented" not in log.read_text()
    assert "a metrics hook failed" not in log.read_text()


def _cpus_allowed(pid: int) -> str:
    status = open(f"/proc/{pid}/status").read()
    return next(line.split()[1] for line in status.splitlines() if line.startswith("Cpus_allowed_list"))


def test_disaggregated_gauges_fall_back_to_idle(tmp_path):
    """Normal finishes, stop strings hit on the very first token (the stop overtakes the KV
    handoff), a client that leaves mid-stream: once the last request is done every gauge comes
    back to 0 and stays there. By default the two engines both use every core, in turns."""
    srv = Server("--mode", "disaggregated", "--kv-cache-memory", "0.3", "--max-model-len", "2048",
                 log=tmp_path / "log")
    try:
        engines = engine_children(srv.proc.pid)
        if len(os.sched_getaffinity(0)) == 2:
            assert sorted(_cpus_allowed(p) for p in engines) == ["0-1", "0-1"]
        prompts = ["Hello", "What is 2+2?", "Name a color.", "Tell me a joke", "The capital of France is",
                   "Write a haiku", "Why is the sky blue?"]

        def chat(prompt: str, **extra) -> int:
            body = {"messages": [{"role": "user", "content": prompt}], "temperature": 0, "max_tokens": 64, **extra}
            return httpx.post(f"{srv.url}/v1/chat/completions", json=body, timeout=120).status_code

        results: list[int] = []
        threads = [threading.Thread(target=lambda p=p: results.append(chat(p))) for p in prompts]
        # stop strings that the first token already contains: the frontend stops the request
        # while its KV is on the way to the decode engine
        # (were it left running there, it would decode on to the end of the context)
        threads += [threading.Thread(target=lambda p=p: results.append(chat(p, stop=list("aeiouTIH "), max_tokens=None,
                                                                            ignore_eos=True)))
                    for p in prompts]
        for t in threads:
            t.start()
        leaver: list[str] = []
        with httpx.stream("POST", f"{srv.url}/v1/completions", timeout=60,
                          json={"prompt": "Once", "max_tokens": 1500, "ignore_eos": True, "stream": True}) as r:
            for line in r.iter_lines():
                leaver.append(line)
                if len(leaver) > 5:
                    break
        for t in threads:
            t.join(120)
        assert results == [200] * len(threads)
        wait_gauges_idle(srv.url, within=120)   # a hang guard
        time.sleep(1.5)   # and they stay there (over a stats message): nothing runs on for a request that ended
        wait_gauges_idle(srv.url, within=0.1)
        assert metric(srv.url, "duoserve:num_requests_kv_leased") == 0
    finally:
        assert srv.stop() in (0, -signal.SIGTERM)


def test_a_slow_engine_is_not_a_dead_one(tmp_path, monkeypatch):
    """A step that sleeps past the silence timeout, with requests in flight: the frontend logs the
    engine as slow, /health says slow (200), nothing fails, and the engine is never relaunched."""
    monkeypatch.setenv("DUOSERVE_FAULT_STEP_SLEEP", "4")
    monkeypatch.setenv("DUOSERVE_SILENCE_TIMEOUT", "1.5")
    log = tmp_path / "log"
    srv = Server("--kv-cache-memory", "0.2", "--max-model-len", "1024", "--dtype", "float32",
                 "--quantization", "none", log=log)
    try:
        (engine_pid,) = engine_children(srv.proc.pid)
        results: list = []

        def ask(i: int) -> None:
            body = {"prompt": f"Count to {i}:", "max_tokens": 6, "temperature": 0}
            results.append(httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60))

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        time.sleep(2.5)   # inside the 4 s step, past the 1.5 s silence timeout
        health = httpx.get(f"{srv.url}/health", timeout=5)
        for t in threads:
            t.join(60)
        assert health.status_code == 200 and health.json() == {"status": "slow", "slow_engines": ["engine-0"]}
        assert [r.status_code for r in results] == [200] * 4
        assert all(r.json()["usage"]["completion_tokens"] == 6 for r in results)
        assert httpx.get(f"{srv.url}/health", timeout=5).json() == {"status": "ok"}
        assert engine_children(srv.proc.pid) == [engine_pid]   # the same engine process: never relaunched
        text = log.read_text()
        assert "slow, not down" in text and "answers again" in text
        assert "is down" not in text and "relaunch" not in text
    finally:
        srv.stop()


def test_drain_an_engine_over_http_while_a_stream_runs_there(tmp_path):
    """``POST /v1/engines/engine-0/drain`` (the API key asked for like every /v1 route): 202 at
    once; a stream it holds ends with the tokens an undisturbed run gives, new requests go to
    engine-1 meanwhile, then engine-0 stops and is launched again (a new process), and /health is
    ok. An unknown engine is a 404 in the OpenAI error shape."""
    srv = Server("--num-engines", "2", "--kv-cache-memory", "0.1", "--max-model-len", "2048", api_key="k3y",
                 log=tmp_path / "log")
    try:
        url, headers = srv.url, srv.headers
        body = {"prompt": "Tell me a long story", "max_tokens": 64, "ignore_eos": True, "temperature": 0}
        want = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=120).json()["choices"][0]["text"]
        assert httpx.post(f"{url}/v1/engines/engine-0/drain", timeout=10).status_code == 401
        missing = httpx.post(f"{url}/v1/engines/engine-9/drain", headers=headers, timeout=10)
        assert missing.status_code == 404 and missing.json()["error"]["param"] == "name"
        before = set(engine_children(srv.proc.pid))
        lines, drained = [], {}
        with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, headers=headers,
                          timeout=120) as r:
            for line in r.iter_lines():
                if line:
                    lines.append(line)
                if len(lines) == 3 and not drained:
                    drained["reply"] = httpx.post(f"{url}/v1/engines/engine-0/drain", headers=headers, timeout=10)
                    drained["again"] = httpx.post(f"{url}/v1/engines/engine-0/drain", headers=headers, timeout=10)
                    drained["new"] = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=120)
        assert drained["reply"].status_code == 202 and drained["reply"].json()["engine"] == "engine-0"
        assert drained["again"].status_code == 409
        assert drained["new"].status_code == 200 and drained["new"].json()["choices"][0]["text"] == want
        text = "".join(json.loads(ln[6:])["choices"][0]["text"] for ln in lines[:-1])
        assert lines[-1] == "data: [DONE]" and text == want
        _wait_for(lambda: len(set(engine_children(srv.proc.pid)) - before) == 1, 60)   # relaunched
        _wait_for(lambda: httpx.get(f"{url}/health", timeout=10).status_code == 200, 60)
    finally:
        srv.stop()
