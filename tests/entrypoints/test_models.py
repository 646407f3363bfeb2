"""Several models behind one server: routing by ``model``, loading past --models-max, sleep.

Real servers with two tiny seeded checkpoints (HF folders, no tokenizer: prompts are token ids
through /generate) or the default model; the references are the same models offline."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.server_helpers import Server, alive, descendants, engine_children, metric

PROMPTS = [[5, 17, 42, 9, 100, 3], [7, 7, 8, 200, 31], [1, 2, 3, 4, 5, 6, 7, 8], [250, 12, 90]]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def two_models(tiny_dir):
    return {"llama": tiny_dir("llama"), "qwen": tiny_dir("qwen2", seed=3)}


@pytest.fixture(scope="module")
def references(two_models):
    """Each model's greedy tokens for each prompt, computed offline, one model at a time."""
    from duoserve import LLM, SamplingParams

    found = {}
    for name, path in two_models.items():
        llm = LLM(model=str(path), dtype="float32", kv_cache_memory=0.05)
        outs = llm.generate(PROMPTS,
                            SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True), use_tqdm=False)
        found[name] = [list(o.outputs[0].token_ids) for o in outs]
    return found


def generate(url: str, model: str | None, prompt: list[int]) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    if model is not None:
        body["model"] = model
    return httpx.post(f"{url}/generate", json=body, timeout=600)


def model_states(url: str) -> dict[str, str]:
    return {m["id"]: m["status"]["value"] for m in httpx.get(f"{url}/v1/models", timeout=10).json()["data"]}


def tiny_args(two_models) -> list[str]:
    return ["--dtype", "float32", "--kv-cache-memory", "0.05", "--num-threads", "1",
            *[arg for name, path in two_models.items() for arg in ("--model", f"{name}={path}")]]


def test_requests_to_two_models_interleaved_get_each_models_tokens(two_models, references, tmp_path):
    server = Server(*tiny_args(two_models), log=tmp_path / "server.log")
    try:
        assert model_states(server.url) == {"llama": "loaded", "qwen": "loaded"}
        assert len(engine_children(server.proc.pid)) == 2
        results, errors = {}, []

        def stream(name: str, i: int) -> None:   # 8 streams at once: both models, every prompt
            response = generate(server.url, name, PROMPTS[i])
            if response.status_code != 200:
                errors.append(response.text)
            else:
                results[name, i] = response.json()["token_ids"]

        threads = [threading.Thread(target=stream, args=(name, i)) for i in range(len(PROMPTS)) for name in two_models]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        for name in two_models:
            assert [results[name, i] for i in range(len(PROMPTS))] == references[name], name
        assert references["llama"] != references["qwen"]   # the two models tell apart

        # the model is named: none is a 400 naming the models; an unknown one a 404
        none = generate(server.url, None, PROMPTS[0])
        assert none.status_code == 400 and none.json()["error"]["param"] == "model"
        assert "`llama`, `qwen`" in none.json()["error"]["message"]
        unknown = generate(server.url, "nope", PROMPTS[0])
        assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"

        # each model's metrics carry its name; the series are one family each
        assert metric(server.url, "duoserve:e2e_request_latency_seconds_count", {"model_name": "llama"}) == len(PROMPTS)
        assert metric(server.url, "duoserve:e2e_request_latency_seconds_count", {"model_name": "qwen"}) == len(PROMPTS)
        assert metric(server.url, "duoserve:model_loads_total", {"model_name": "qwen"}) == 1

        # unloaded on request: its engine ends, the other serves on, and a request loads it again
        engines = set(engine_children(server.proc.pid))
        assert httpx.post(f"{server.url}/models/unload", json={"model": "qwen"}, timeout=60).json() == {"success": True}
        assert model_states(server.url) == {"llama": "loaded", "qwen": "unloaded"}
        assert len(set(engine_children(server.proc.pid)) & engines) == 1
        again = httpx.post(f"{server.url}/models/unload", json={"model": "qwen"}, timeout=60)
        assert again.status_code == 400 and "is not loaded" in again.json()["error"]["message"]
        assert generate(server.url, "qwen", PROMPTS[1]).json()["token_ids"] == references["qwen"][1]
        assert model_states(server.url)["qwen"] == "loaded"
        assert metric(server.url, "duoserve:model_loads_total", {"model_name": "qwen"}) == 2
        assert metric(server.url, "duoserve:model_unloads_total", {"model_name": "qwen", "reason": "request"}) == 1
    finally:
        assert server.stop() == -15   # drained, then ended by the SIGTERM it was sent
    assert not [pid for pid in descendants(server.proc.pid) if alive(pid)]


def test_models_max_one_alternating_loads_and_unloads_each_time_and_fails_nothing(two_models, references, tmp_path):
    server = Server(*tiny_args(two_models), "--models-max", "1", log=tmp_path / "server.log")
    try:
        assert model_states(server.url) == {"llama": "loaded", "qwen": "unloaded"}   # --model's first, up to the max
        order = ["qwen", "llama"]
        for i, name in enumerate(order):
            response = generate(server.url, name, PROMPTS[i])
            assert response.status_code == 200, response.text
            assert response.json()["token_ids"] == references[name][i]
            assert model_states(server.url)[name] == "loaded"
            assert len(engine_children(server.proc.pid)) == 1   # the other's engine ended before it loaded
        assert metric(server.url, "duoserve:model_loads_total", {"model_name": "qwen"}) == 1
        assert metric(server.url, "duoserve:model_loads_total", {"model_name": "llama"}) == 2
        assert metric(server.url, "duoserve:model_unloads_total", {"reason": "models_max"}) == 2

        # at once, alternating: each waits its turn, nothing fails
        results, errors = {}, []

        def stream(name: str, i: int) -> None:
            response = generate(server.url, name, PROMPTS[i])
            (results.__setitem__((name, i), response.json()["token_ids"]) if response.status_code == 200
             else errors.append(response.text))

        threads = [threading.Thread(target=stream, args=(name, i)) for i in range(2) for name in ("llama", "qwen")]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        assert all(tokens == references[name][i] for (name, i), tokens in results.items())
    finally:
        assert server.stop() == -15   # drained, then ended by the SIGTERM it was sent


def test_no_autoload_answers_400_until_loaded_and_a_model_that_fails_to_load_is_a_503(two_models, tmp_path):
    models_dir = tmp_path / "models"
    models_dir.mkdir()
    (models_dir / "broken.gguf").write_bytes(b"GGUF" + b"\0" * 60)   # a file, but no model
    server = Server(*tiny_args(two_models), "--models-max", "1", "--no-models-autoload", "--models-dir",
                    str(models_dir), log=tmp_path / "server.log")
    try:
        assert model_states(server.url) == {"llama": "loaded", "qwen": "unloaded", "broken": "unloaded"}
        failed = httpx.post(f"{server.url}/models/load", json={"model": "broken"}, timeout=600)
        assert failed.status_code == 503 and failed.json()["error"]["code"] == "model_load_failed"
        listed = {m["id"]: m["status"] for m in httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"]}
        assert listed["broken"]["value"] == "unloaded" and listed["broken"]["error"]
        assert metric(server.url, "duoserve:model_load_failures_total", {"model_name": "broken"}) == 1
        # room was made for it first (as llama.cpp's router does): the least recently used went
        assert model_states(server.url) == {"llama": "unloaded", "qwen": "unloaded", "broken": "unloaded"}
        refused = generate(server.url, "qwen", PROMPTS[0])
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "model_not_loaded"
        assert "POST /models/load" in refused.json()["error"]["message"]
        assert httpx.post(f"{server.url}/models/load", json={"model": "qwen"}, timeout=600).json() == {"success": True}
        assert model_states(server.url) == {"llama": "unloaded", "qwen": "loaded", "broken": "unloaded"}
        assert generate(server.url, "qwen", PROMPTS[0]).status_code == 200
    finally:
        assert server.stop() == -15   # drained, then ended by the SIGTERM it was sent


def tree_rss(pid: int) -> int:
    from duoserve.worker.memory import rss_bytes

    return sum(rss_bytes(p) for p in [pid, *descendants(pid)])


def test_an_idle_model_sleeps_its_engines_end_and_the_next_request_wakes_it(tmp_path):
    server = Server("--sleep-idle-seconds", "2", "--kv-cache-memory", "0.25", "--num-threads", "2",
                    log=tmp_path / "server.log")
    try:
        chat = {"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 8, "temperature": 0}
        first = httpx.post(f"{server.url}/v1/chat/completions", json=chat, timeout=600).json()
        report = httpx.get(f"{server.url}/v1/memory", timeout=10).json()
        (engine_report,) = report["engines"].values()
        held = sum(engine_report["weights_bytes"].values()) + engine_report["kv_pool"]["resident_bytes"]
        before = tree_rss(server.proc.pid)
        (engine_pid,) = engine_children(server.proc.pid)

        deadline = time.monotonic() + 120
        while model_states(server.url) != {"smollm2-135m": "sleeping"}:
            assert time.monotonic() < deadline, model_states(server.url)
            time.sleep(0.2)
        assert not alive(engine_pid) and engine_children(server.proc.pid) == []
        after = tree_rss(server.proc.pid)
        assert before - after >= held, (before, after, held)
        memory = httpx.get(f"{server.url}/v1/memory", timeout=10).json()
        assert memory["engines"] == {} and memory["models"]["smollm2-135m"]["freed_bytes"] >= held

        # /health does not wake it; a request does, with the same answer
        assert httpx.get(f"{server.url}/health", timeout=10).json() == {"status": "ok", "model": "sleeping"}
        time.sleep(0.5)
        assert model_states(server.url) == {"smollm2-135m": "sleeping"}
        again = httpx.post(f"{server.url}/v1/chat/completions", json=chat, timeout=600).json()
        assert again["choices"][0]["message"] == first["choices"][0]["message"]
        assert metric(server.url, "duoserve:model_unloads_total", {"reason": "idle"}) == 1
        assert httpx.get(f"{server.url}/health", timeout=10).json() == {"status": "ok"}
    finally:
        assert server.stop() == -15   # drained, then ended by the SIGTERM it was sent
