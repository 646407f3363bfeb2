"""The GPU side of the KV handoff: pinned host buffers and non-blocking copies.

Skipped without a CUDA device. On a GPU machine: ``python -m pytest -m cuda``.
"""

from __future__ import annotations

import pytest
import torch

from duoserve import SamplingParams
from duoserve.config import CacheConfig, EngineConfig, ModelConfig
from duoserve.core.request import Request
from duoserve.engine.builder import build_engine
from duoserve.entrypoints.llm import LLM
from duoserve.kv.connector import InProcessConnector
from duoserve.kv.staging import pinned_like, to_device, to_host

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_staging_goes_through_pinned_memory_both_ways():
    host = [torch.randn(37, 2, 16), torch.randn(37, 2, 16)]
    assert all(v.is_pinned() for v in pinned_like(host))
    on_gpu = to_device(host, torch.device("cuda"))
    assert all(t.device.type == "cuda" for t in on_gpu)
    back = to_host(on_gpu)
    assert all(t.is_pinned() and t.device.type == "cpu" for t in back)
    assert all(torch.equal(a, b) for a, b in zip(back, host))


def test_cpu_prefill_gpu_decode_equals_colocated(tiny_dir):
    path = tiny_dir(kind="llama")
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    prompts = [[(7 * i + j) % 256 for j in range(n)] for i, n in enumerate((1, 9, 40, 100))]
    reference = [o.outputs[0] for o in LLM(str(path), dtype="float32", kv_cache_memory=0.01)
                 .generate(prompts, params, use_tqdm=False)]

    def engine(role, device, block):
        return build_engine(EngineConfig(model=ModelConfig(model=str(path), dtype="float32", device=device),
                                         cache=CacheConfig(block_size=block, kv_cache_memory=0.01), role=role))

    prefill, decode = engine("prefill", "cpu", 16), engine("decode", "cuda", 32)
    link = InProcessConnector()
    prefill.attach_connector(link)
    decode.attach_connector(link)
    tokens = {f"r{i}": [] for i in range(len(prompts))}
    for i, prompt in enumerate(prompts):
        prefill.add_request(Request(f"r{i}", prompt, params, (), 512))
    for _ in range(500):
        for out in prefill.step() + decode.step():
            tokens[out.request_id][out.position:] = out.new_token_ids
        if not prefill.has_unfinished() and not decode.has_unfinished():
            break
    for i, want in enumerate(reference):
        got = tokens[f"r{i}"]
        assert len(got) == 16
        for j, (a, b) in enumerate(zip(got, want.token_ids)):
            if a != b:  # GPU and CPU sums differ in the last bits: only a near-tie may flip a token
                top = want.logprobs[j].top
                assert top[0][1] - top[1][1] < 1e-3, f"request {i} token {j}: {a} vs {b} away from a tie"
                break
    assert decode.kv.pool.num_free_blocks == decode.kv.pool.num_blocks
    assert prefill.kv.pool.num_free_blocks == prefill.kv.pool.num_blocks
