"""``duoserve bench serve`` against a server with known delays, and against duoserve itself."""

from __future__ import annotations

import asyncio
import json
import random
import socket
import statistics
import threading
import time

import pytest
from fastapi import Request

from duoserve.bench import report, workloads
from duoserve.bench.client import run
from duoserve.bench.workloads import BenchRequest
from duoserve.errors import ConfigError

FIRST_MS, EVERY_MS, TOKENS = 120, 25, 12


def fake_server():
    """An OpenAI-style streaming server: the first token FIRST_MS after the request, then one every
    EVERY_MS; a prompt containing FAIL gets HTTP 500, one containing CUT a broken stream."""
    import uvicorn
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, StreamingResponse

    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        if "FAIL" in body["prompt"]:
            return JSONResponse({"error": {"message": "injected", "type": "server_error"}}, status_code=500)
        count = body["max_tokens"]

        async def events():
            await asyncio.sleep(FIRST_MS / 1000)
            for i in range(count):
                if i:
                    await asyncio.sleep(EVERY_MS / 1000)
                if "CUT" in body["prompt"] and i == 3:
                    yield 'data: {"error": {"message": "engine died", "code": 503}}\n\n'
                    return
                chunk = {"choices": [{"index": 0, "text": f" t{i}", "finish_reason": None}]}
                yield f"data: {json.dumps(chunk)}\n\n"
            usage = {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": count}}
            yield f"data: {json.dumps(usage)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    return server, f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def fake():
    server, url = fake_server()
    yield url
    server.should_exit = True


def test_latencies_throughput_goodput_and_errors_come_out_right(fake):
    good = [BenchRequest(f"prompt {i}", 5, TOKENS) for i in range(16)]
    bad = [BenchRequest("FAIL", 4, TOKENS), BenchRequest("FAIL too", 4, TOKENS), BenchRequest("CUT here", 4, TOKENS)]
    records, seconds = asyncio.run(run(fake, "/v1/completions", "fake-model", good + bad, float("inf"),
                                       max_concurrency=8))
    result = report.summarize(records, seconds, {"dataset": "fixed"}, report.parse_goodput(["ttft:200", "tpot:40"]))
    import jsonschema

    jsonschema.validate(json.loads(json.dumps(result)), report.RESULT_SCHEMA)
    assert result["completed"] == 16 and result["failed"] == 3
    assert result["errors"] == {"http_5xx": 2, "stream": 1}
    assert result["total_output_tokens"] == 16 * TOKENS
    # Only what the fake server's sleeps guarantee is asserted, never an upper bound: on a loaded
    # machine the client reads late, which lengthens the times (and can bunch the chunks).
    ok = [r for r in records if r.ok]
    assert len(ok) == 16 and all(len(r.chunk_times) == TOKENS == r.output_tokens for r in ok)
    ttft = [r.chunk_times[0] - r.start for r in ok]
    e2el = [r.end - r.start for r in ok]
    assert min(ttft) >= FIRST_MS / 1000
    assert min(e2el) >= (FIRST_MS + (TOKENS - 1) * EVERY_MS) / 1000
    # the report is the statistics of those records
    assert result["ttft_ms"]["p50"] == pytest.approx(1000 * statistics.median(ttft))
    assert result["e2el_ms"]["mean"] == pytest.approx(1000 * statistics.mean(e2el))
    itl = [b - a for r in ok for a, b in zip(r.chunk_times, r.chunk_times[1:])]
    assert len(result["samples"]["itl_ms"]) == 16 * (TOKENS - 1)
    assert result["itl_ms"]["p50"] == pytest.approx(1000 * statistics.median(itl))
    tpot = [(r.chunk_times[-1] - r.chunk_times[0]) / (TOKENS - 1) for r in ok]
    assert result["tpot_ms"]["mean"] == pytest.approx(1000 * statistics.mean(tpot))
    good = sum(t <= 0.2 and p <= 0.04 for t, p in zip(ttft, tpot))
    assert result["goodput_requests"] == good and result["goodput"] == pytest.approx(good / seconds)
    strict = report.summarize(records, seconds, {}, report.parse_goodput(["ttft:50"]))
    assert strict["goodput"] == 0.0
    assert "completed" in report.table(result) and "TTFT" in report.table(result)


def test_request_rate_spaces_the_sends(fake):
    """Poisson arrivals at 20/s, seed 1: exponential gaps of mean 50 ms, drawn as the client
    documents. A send can start late on a loaded machine, never early: request j starts after
    request i + 1 was created, so the span from i to j is at least the gaps in between."""
    requests = [BenchRequest(f"p{i}", 5, 2) for i in range(30)]
    records, _ = asyncio.run(run(fake, "/v1/completions", "fake-model", requests, request_rate=20.0, seed=1))
    rng = random.Random(1)
    gaps = [rng.gammavariate(1.0, 1 / 20) for _ in requests]
    assert 0.03 < statistics.mean(gaps[:-1]) < 0.08
    starts = [r.start for r in records]
    assert starts == sorted(starts)
    for i, j in [(0, 29), (0, 15), (15, 29)] + [(k, k + 2) for k in range(28)]:
        assert starts[j] - starts[i] >= sum(gaps[i + 1:j]) - 1e-3, (i, j)


def test_workloads_have_the_lengths_they_promise(tmp_path):
    from duoserve.bench.serve import load_tokenizer

    tokenizer = load_tokenizer(None)
    random_prompts = workloads.build("random", tokenizer, 6, 64, 32, seed=3)
    assert [r.prompt_len for r in random_prompts] == [64] * 6 and {r.output_len for r in random_prompts} == {32}
    mixed = workloads.build("mixed:16:0.5,200:0.5", tokenizer, 40, 0, 8, seed=3)
    assert {r.prompt_len for r in mixed} == {16, 200}
    shared = workloads.build("shared-prefix", tokenizer, 3, 16, 8, prefix_len=100, seed=3)
    heads = {r.prompt[:200] for r in shared}
    assert len(heads) == 1 and all(r.prompt_len >= 110 for r in shared)
    several = workloads.build("shared-prefix", tokenizer, 30, 16, 8, prefix_len=100, seed=3, num_prefixes=3)
    assert len({r.prompt[:200] for r in several}) == 3
    with pytest.raises(ConfigError, match="num_prefixes"):
        workloads.build("shared-prefix", tokenizer, 3, 16, 8, prefix_len=100, num_prefixes=0)
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "Hello there", "output_len": 5}\n{"prompt": "Bye"}\n')
    from_file = workloads.build(f"jsonl:{path}", tokenizer, 3, 0, 9)
    assert [(r.prompt, r.output_len) for r in from_file] == [("Hello there", 5), ("Bye", 9), ("Hello there", 5)]
    for bad in ("mixed:16:0.5", "mixed:x", "jsonl:/nope.jsonl", "sharegpt"):
        with pytest.raises(ConfigError, match="dataset"):
            workloads.build(bad, tokenizer, 2, 8, 8)


def test_bench_serve_against_duoserve_reports_its_stages(tmp_path, server):
    """A short run of each workload against a real duoserve server (the session's: the client
    only reads it): stage breakdown present."""
    import subprocess
    import sys

    import jsonschema

    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text('{"prompt": "Name three colors.", "output_len": 8}\n')
    for i, dataset in enumerate(("random", "mixed:16:0.5,64:0.5", "shared-prefix", f"jsonl:{jsonl}")):
        out = tmp_path / f"run{i}.json"
        result = subprocess.run([sys.executable, "-m", "duoserve.cli", "bench", "serve", "--base-url", server.url,
                                 "--dataset", dataset, "--num-prompts", "4", "--input-len", "32",
                                 "--output-len", "8", "--prefix-len", "64", "--max-concurrency", "2",
                                 "--result-json", str(out), "--quiet", "--plot", str(tmp_path / f"run{i}.png"),
                                 "--api-key", server.api_key],
                                capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr
        data = json.loads(out.read_text())
        jsonschema.validate(data, report.RESULT_SCHEMA)
        assert data["completed"] == 4 and data["failed"] == 0, dataset
        assert data["config"]["model"] == "smollm2-135m"
        stages = data["server"]
        assert stages["ttft_queue_mean_ms"] >= 0 and stages["ttft_prefill_mean_ms"] > 0
        if dataset == "shared-prefix":
            assert stages["prefix_cache_hit_rate"] > 0.3
        assert "TTFT" in result.stdout and "ttft_prefill_mean_ms" in result.stdout
        assert len(data["samples"]["ttft_ms"]) == 4 and len(data["samples"]["token_times_s"]) >= 4
    import matplotlib.pyplot as plt

    image = plt.imread(tmp_path / "run0.png")
    assert image.shape[0] > 300 and image.shape[1] > 300 and image.std() > 0.01   # a figure, not a blank
    compared = subprocess.run([sys.executable, "-m", "duoserve.cli", "bench", "compare", str(tmp_path / "run0.json"),
                               str(tmp_path / "run2.json"), "--plot", str(tmp_path / "both.png")],
                              capture_output=True, text=True, timeout=120)
    assert compared.returncode == 0, compared.stderr
    header = compared.stdout.splitlines()[0].split()
    assert header == ["run0", "run2"] and "ttft p99 ms" in compared.stdout
    assert (tmp_path / "both.png").stat().st_size > 10_000


def test_sweep_finds_the_highest_point_that_meets_the_slo(fake, tmp_path):
    from duoserve.bench import sweep

    requests = [BenchRequest(f"p{i}", 5, 4) for i in range(8)]
    # first token at 120 ms: a TTFT bound far above it holds at both points (requests do not
    # queue), even on a loaded machine; one below it (100 ms) can never hold
    results, best = sweep.sweep(fake, "/v1/completions", "fake-model", requests, [1, 4], "concurrency",
                                report.parse_goodput(["ttft:5000"]), 0.9, False, None, 0)
    assert [r["config"]["concurrency"] for r in results] == [1, 4]
    assert all(r["slo_met_fraction"] == 1.0 for r in results) and best == 4
    results, best = sweep.sweep(fake, "/v1/completions", "fake-model", requests, [1, 4], "concurrency",
                                report.parse_goodput(["ttft:100"]), 0.9, False, None, 0)
    assert best is None and all(r["slo_met_fraction"] == 0.0 for r in results)
    text = sweep.table(results, "concurrency", best)
    assert "highest concurrency meeting the SLO: none" in text
    sweep.plot(results, "concurrency", str(tmp_path / "sweep.png"))
    assert (tmp_path / "sweep.png").stat().st_size > 10_000


def test_prompts_histogram_and_suggestions(tmp_path):
    from duoserve.bench.prompts import prompt_lengths, report as prompts_report, suggest
    from duoserve.bench.serve import load_tokenizer

    tokenizer = load_tokenizer(None)
    path = tmp_path / "requests.jsonl"
    lines = [json.dumps({"prompt": " ".join(["word"] * n)}) for n in (10, 20, 30, 40, 3000)]
    lines.append(json.dumps({"messages": [{"role": "user", "content": "Hi"}]}))
    path.write_text("\n".join(lines) + "\n")
    lengths = prompt_lengths(path, tokenizer)
    assert lengths[:5] == [10, 20, 30, 40, 3000]     # " word" is one token of this vocabulary
    assert lengths[5] == len(tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}]),
                                              add_special_tokens=False))
    advice = {flag: value for flag, value, _ in suggest(lengths, 256, 46080)}
    p90 = int(__import__("numpy").percentile(lengths, 90))
    assert advice["--max-prefill-len"] == str(p90)
    assert advice["--max-num-batched-tokens"] == str(-(-p90 // 256) * 256)
    assert advice["--block-size"] == "16"
    text = prompts_report(path, tokenizer, 256, 46080)
    assert "6 requests" in text and "2049-4096" in text and "--swap-space" in text
    path.write_text('{"text": "no prompt"}\n')
    with pytest.raises(ConfigError, match="prompt"):
        prompt_lengths(path, tokenizer)
