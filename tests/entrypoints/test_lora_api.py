"""LoRA adapters over HTTP: a request names an adapter in ``model`` (vLLM's convention), /v1/models
lists each with its base as ``parent``, and the prefix cache keeps adapters apart (the metrics)."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from duoserve import LLM, LoRARequest, SamplingParams
from tests.e2e.test_lora import make_tiny_lora
from tests.server_helpers import Server, metric, wait_metric

PROMPT = list(range(40, 80))   # 40 tokens: two full blocks of 16
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def setup(tiny_dir, tmp_path_factory):
    base = tiny_dir("llama")
    root = tmp_path_factory.mktemp("lora-api")
    adapters = {name: make_tiny_lora(base, root / name, seed) for name, seed in (("a", 21), ("b", 22))}
    llm = LLM(model=str(base), dtype="float32", kv_cache_memory=0.05,
              lora_modules=[f"{n}={p}" for n, p in adapters.items()])
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    reference = {name: list(llm.generate([PROMPT], params, use_tqdm=False,
                                         lora_request=LoRARequest(name) if name else None)[0].outputs[0].token_ids)
                 for name in ("a", "b", None)}
    server = Server("--model", str(base), "--served-model-name", "tiny", "--dtype", "float32",
                    "--kv-cache-memory", "0.05", "--num-threads", "1", "--lora-modules",
                    *[f"{n}={p}" for n, p in adapters.items()], log=root / "server.log")
    yield server, adapters, reference
    server.stop()


def generate(url: str, model: str | None) -> httpx.Response:
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    if model is not None:
        body["model"] = model
    return httpx.post(f"{url}/generate", json=body, timeout=600)


def test_models_lists_each_adapter_with_its_base(setup):
    server, adapters, _ = setup
    data = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"]
    assert [(m["id"], m.get("parent"), m.get("root")) for m in data] == [
        ("tiny", None, None), ("a", "tiny", str(adapters["a"])), ("b", "tiny", str(adapters["b"]))]


def test_requests_name_their_adapter_and_mixed_at_once_get_its_tokens(setup):
    server, _, reference = setup
    results, errors = {}, []

    def run(model, i):
        response = generate(server.url, model)
        (results.__setitem__((model, i), response.json()["token_ids"]) if response.status_code == 200
         else errors.append(response.text))

    threads = [threading.Thread(target=run, args=(model, i)) for i in range(2) for model in ("a", "b", "tiny")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    for (model, _), got in results.items():
        assert got == reference[None if model == "tiny" else model], model
    completion = httpx.post(f"{server.url}/v1/completions", json={"model": "b", "prompt": PROMPT, "max_tokens": 2},
                            timeout=600).json()
    assert completion["model"] == "b"
    # embeddings too: the adapter's hidden states, not the base's
    vectors = {m: httpx.post(f"{server.url}/v1/embeddings", json={"model": m, "input": PROMPT}, timeout=600).json()
               for m in ("a", "tiny")}
    assert vectors["a"]["model"] == "a"
    assert vectors["a"]["data"][0]["embedding"] != vectors["tiny"]["data"][0]["embedding"]
    unknown = generate(server.url, "c")
    assert unknown.status_code == 404 and "`tiny`" in unknown.json()["error"]["message"]


def test_an_adapters_prompt_after_anothers_gets_no_prefix_hit(setup):
    server, _, _ = setup
    prompt = list(range(100, 149))   # three full blocks and a token, asked of nobody before
    queries = "duoserve:prefix_cache_queries_total"
    previous = None
    while previous != (now := metric(server.url, queries)):   # the earlier tests' stats all in
        previous = now
        time.sleep(1.5)   # the engine sends stats once a second
    start_hits = metric(server.url, "duoserve:prefix_cache_hits_total")

    def cached(model: str) -> int:
        body = {"model": model, "prompt": prompt, "max_tokens": 1}
        response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=600).json()
        return response["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert [cached(m) for m in ("a", "b", "tiny", "a")] == [0, 0, 0, 48]   # b and the base find none of a's
    wait_metric(server.url, queries, lambda v: v >= previous + 4 * len(prompt))
    assert metric(server.url, "duoserve:prefix_cache_hits_total") == start_hits + 48


def test_adapters_loaded_and_unloaded_while_serving_fail_no_request(tiny_dir, tmp_path):
    base = tiny_dir("llama")
    adapters = {name: make_tiny_lora(base, tmp_path / name, seed) for name, seed in (("a", 31), ("b", 32), ("c", 33))}
    other_base = make_tiny_lora(tiny_dir("llama", hidden_size=96), tmp_path / "other", 34)
    llm = LLM(model=str(base), dtype="float32", kv_cache_memory=0.05, enable_lora=True)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    reference = {name: list(llm.generate([PROMPT], params, use_tqdm=False, lora_request=LoRARequest(
        name, 1, str(path)))[0].outputs[0].token_ids) for name, path in adapters.items()}
    server = Server("--model", str(base), "--dtype", "float32", "--kv-cache-memory", "0.05", "--num-threads", "1",
                    "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8", log=tmp_path / "server.log")
    load, unload = f"{server.url}/v1/load_lora_adapter", f"{server.url}/v1/unload_lora_adapter"
    failures, done = [], threading.Event()

    def background() -> None:   # the base model's requests all along: none may fail
        while not done.is_set():
            response = generate(server.url, None)
            if response.status_code != 200:
                failures.append(response.text)

    worker = threading.Thread(target=background)
    worker.start()
    try:
        loaded = httpx.post(load, json={"lora_name": "a", "lora_path": str(adapters["a"])}, timeout=60)
        assert loaded.status_code == 200 and loaded.text == "Success: LoRA adapter 'a' added successfully."
        assert generate(server.url, "a").json()["token_ids"] == reference["a"]
        again = httpx.post(load, json={"lora_name": "a", "lora_path": str(adapters["a"])}, timeout=60)
        assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
        assert httpx.post(load, json={"lora_name": "a", "lora_path": str(adapters["a"]), "load_inplace": True},
                          timeout=60).status_code == 200

        # unloading an adapter in use waits for its request, which finishes whole
        long = {}
        streaming = threading.Thread(target=lambda: long.setdefault("r", httpx.post(
            f"{server.url}/generate", json={"model": "a", "prompt": PROMPT, "max_tokens": 460, "ignore_eos": True},
            timeout=600)))
        streaming.start()
        deadline = time.monotonic() + 120
        while not metric(server.url, "duoserve:lora_requests", {"adapter": "a"}):   # in flight, as /metrics says
            assert streaming.is_alive() and time.monotonic() < deadline, long.get("r") and long["r"].text
            time.sleep(0.02)
        removed = httpx.post(unload, json={"lora_name": "a"}, timeout=120)
        streaming.join()
        assert removed.status_code == 200 and removed.text == "Success: LoRA adapter 'a' removed successfully."
        assert long["r"].status_code == 200 and len(long["r"].json()["token_ids"]) == 460
        assert generate(server.url, "a").status_code == 404
        assert httpx.post(unload, json={"lora_name": "a"}, timeout=60).status_code == 404

        # loaded again, and past --max-loras: the least recently used is read again when asked for
        for name in ("a", "b", "c"):
            assert httpx.post(load, json={"lora_name": name, "lora_path": str(adapters[name])},
                              timeout=60).status_code == 200
        for name in ("a", "b", "c", "a"):
            assert generate(server.url, name).json()["token_ids"] == reference[name], name

        # a bad adapter: 400 naming why, nothing listed, the server serves on
        bad = httpx.post(load, json={"lora_name": "x", "lora_path": str(other_base)}, timeout=60)
        assert bad.status_code == 400 and "another base model" in bad.json()["error"]["message"]
        missing = httpx.post(load, json={"lora_name": "y", "lora_path": str(tmp_path / "none")}, timeout=60)
        assert missing.status_code == 400 and "no PEFT folder" in missing.json()["error"]["message"]
        listed = [m["id"] for m in httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"]]
        assert listed[1:] == ["a", "b", "c"]
        text = httpx.get(f"{server.url}/metrics", timeout=10).text
        assert 'vllm:lora_requests_info{max_lora="2"' in text
    finally:
        done.set()
        worker.join()
        server.stop()
    assert failures == []


def test_disaggregated_engines_compute_the_adapter_on_both_sides(setup, tiny_dir, tmp_path):
    """The prefill engine computes the prompt with the adapter, the decode engine goes on with
    it: the same tokens as one engine (the handoff carries the adapter's digest, checked)."""
    _, adapters, reference = setup
    server = Server("--model", str(tiny_dir("llama")), "--dtype", "float32", "--kv-cache-memory", "0.05",
                    "--mode", "disaggregated", "--lora-modules", *[f"{n}={p}" for n, p in adapters.items()],
                    log=tmp_path / "server.log")
    try:
        for model in ("a", "b", None):
            response = generate(server.url, model)
            assert response.status_code == 200, response.text
            assert response.json()["token_ids"] == reference[model], model
        assert metric(server.url, "duoserve:kv_transfer_seconds_count") >= 3   # each went through the handoff
    finally:
        server.stop()
