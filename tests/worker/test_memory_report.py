"""The memory report: it adds up, it is served, and --dry-run plans (and refuses) without loading."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx

from duoserve.metrics import memory_kinds
from duoserve.worker.memory import estimate_prefill_scratch


def read_arch():
    """The default model's hyper-parameters, from its file's header (no weights read)."""
    from duoserve.model.gguf_loader import open_gguf
    from duoserve.model.loader import default_model_path

    return open_gguf(default_model_path(), {})[2]


def test_the_report_adds_up_to_the_resident_size():
    """runtime (measured before the model) + loading + weights + resident KV pages (its own pages,
    not its mapping's): within 10 % of the process's resident size after the first forward; the
    prefill scratch is measured and positive. In a fresh process, as an engine is: in the test
    run's own process the models of earlier tests leave freed memory that a new one reuses."""
    code = ("import json; from duoserve import LLM; llm = LLM(None, dtype='float32', quantization='none', "
            "kv_cache_memory=0.5); print(json.dumps(llm.engine.memory))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "DUOSERVE_MEASURE_SCRATCH": "1"})
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    weights = sum(report["weights_bytes"].values())
    assert 500 * 2**20 < weights < 560 * 2**20                 # 135M parameters in fp32
    pool = report["kv_pool"]
    assert pool["bytes"] == pool["blocks"] * 16 * 46080 and pool["tokens"] == pool["blocks"] * 16
    # written whole at start: all of it resident (its first and last pages may hold other data)
    assert pool["bytes"] <= pool["resident_bytes"] <= pool["bytes"] + 2 * 4096
    # measured (DUOSERVE_MEASURE_SCRATCH=1 above): within half of the estimate every engine reports otherwise
    estimate = estimate_prefill_scratch(read_arch(), report["prefill_scratch_tokens"], 4)
    assert report["prefill_scratch_measured"] is True
    assert 0.5 * estimate < report["prefill_scratch_bytes"] < 1.5 * estimate, (report["prefill_scratch_bytes"], estimate)
    # loading (measured before the first forward): the tokenizer, the loader's leftovers
    assert 0 < report["loading_bytes"] < 300 * 2**20
    parts = report["runtime_bytes"] + report["loading_bytes"] + weights + pool["resident_bytes"]
    assert abs(report["rss_bytes"] - parts) <= 0.10 * report["rss_bytes"], (parts, report["rss_bytes"])
    kinds = memory_kinds(report)
    assert kinds["weights_dense"] == weights and kinds["kv_pool_reserved"] == pool["bytes"]


def test_memory_is_served_and_exported(server):
    from tests.server_helpers import metric

    reply = httpx.get(f"{server.url}/v1/memory", headers=server.headers, timeout=10).json()
    (report,) = reply["engines"].values()
    assert report["kv_pool"]["blocks"] > 0 and report["rss_bytes"] > 0 and reply["api_process_rss_bytes"] > 0
    assert metric(server.url, "duoserve:memory_bytes", {"kind": "kv_pool_reserved"}, server.headers) == \
        report["kv_pool"]["bytes"]


def duoserve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "duoserve.cli", *args], capture_output=True, text=True, timeout=120)


def test_dry_run_prints_the_plan_and_refuses_what_cannot_fit():
    result = duoserve("serve", "--dry-run", "--dtype", "float32", "--quantization", "none", "--kv-cache-memory", "0.5")
    assert result.returncode == 0, result.stderr
    assert "KV pool        512 MB: 728 blocks, 11,648 tokens of float32 (46,080 bytes a token)" in result.stdout
    assert "largest batch  1 sequences at the full context of 8,192 tokens" in result.stdout
    refused = duoserve("serve", "--dry-run", "--kv-cache-memory", "100000")
    assert refused.returncode == 2
    assert refused.stderr.startswith("duoserve: error: kv_cache_memory=100000.0 is not allowed: a plan that fits:")
    assert "GiB is available" in refused.stderr
    # bfloat16 named: what auto is depends on the CPU (float32 without native bf16)
    small = duoserve("serve", "--dry-run", "--kv-cache-memory", "0.01", "--dtype", "bfloat16")   # capped, said
    assert small.returncode == 0 and "max_model_len capped at 464 tokens, what a KV pool of 0.01 GiB holds " \
        "(the model's 8,192 would need 0.18 GiB)" in small.stdout
    assert "1 sequences at the full context of 464 tokens" in small.stdout
    asked = duoserve("serve", "--dry-run", "--kv-cache-memory", "0.01", "--max-model-len", "8192", "--dtype", "bfloat16")
    assert asked.returncode == 2 and "one 8,192-token sequence needs 0.1758 GiB of KV cache, more than the 0.01 " \
        "GiB given. Give --max-model-len 256 or --kv-cache-memory 0.2" in asked.stderr
