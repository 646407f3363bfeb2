"""Prompt log-probabilities are right whatever the prefix cache holds (lm-eval's multiple choice).

lm-evaluation-harness (``local-completions``, ``tokenized_requests=True``) scores each choice
by sending context + continuation as token ids with ``echo``, ``logprobs: 1`` and
``max_tokens: 1``, and sums ``token_logprobs[ctxlen:-1]``. The choices share the context, so
from the second one on its blocks are in the prefix cache; each sum must still equal
transformers'.
"""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest
import torch

from duoserve import LLM, SamplingParams
from duoserve.config import CacheConfig, DisaggConfig, EngineConfig, ModelConfig, SchedulerConfig
from duoserve.engine.builder import build_engine
from duoserve.frontend.async_engine import AsyncEngine
from tests.disagg_helpers import settled_stats
from tests.helpers import assert_pool_whole, hf_model
from tests.server_helpers import Server

CONTEXT = "Question: which planet is known as the red planet, and why is it called that? Answer:"
CHOICES = [" Mars", " Venus, because of its clouds", " Jupiter", " the Moon"]
PARAMS = SamplingParams(temperature=0, max_tokens=1, logprobs=1, prompt_logprobs=1)


def reference_sums(model, context: list[int], conts: list[list[int]]) -> list[float]:
    """transformers' log-likelihood of each continuation given the context (fp32)."""
    sums = []
    for cont in conts:
        ids = context + cont
        with torch.no_grad():
            lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
        sums.append(sum(lp[i - 1, ids[i]].item() for i in range(len(context), len(ids))))
    return sums


@pytest.fixture(scope="module")
def smol_case(hf_default_model):
    tokenizer, model = hf_default_model
    context = tokenizer.encode(CONTEXT)
    conts = [tokenizer.encode(c, add_special_tokens=False) for c in CHOICES]
    return context, conts, reference_sums(model, context, conts)


def lm_eval_sum(choice: dict, ctxlen: int) -> float:
    """What lm-eval's ``parse_logprobs`` computes from one choice."""
    return sum(choice["logprobs"]["token_logprobs"][ctxlen:-1])


def check_offline(llm: LLM, context, conts, want) -> None:
    one_by_one = [llm.generate([context + c], PARAMS, use_tqdm=False)[0] for c in conts]
    together = llm.generate([context + c for c in conts], PARAMS, use_tqdm=False)
    for outs in (one_by_one, together):
        for out, cont, expected in zip(outs, conts, want):
            assert len(out.prompt_logprobs) == len(context) + len(cont)
            assert out.prompt_logprobs[0] is None
            got = sum(e.logprob for e in out.prompt_logprobs[len(context):])
            assert abs(got - expected) < 1e-4, (got, expected)
            assert out.num_cached_tokens == 0, "a request that scores its prompt computes all of it"
    assert_pool_whole(llm)


def test_offline_prefix_cache_and_chunks(default_model, smol_case):
    """Prefix caching on, and a 16-token step budget: every prompt is prefilled in chunks."""
    context, conts, want = smol_case
    config = EngineConfig(model=ModelConfig(dtype="float32", quantization="none"), cache=CacheConfig(kv_cache_memory=0.5),
                          scheduler=SchedulerConfig(max_num_batched_tokens=16))
    llm = LLM.from_engine(build_engine(config, loaded=default_model))
    check_offline(llm, context, conts, want)
    # the scored prompts' blocks were still cached for others: a plain request hits them
    plain = llm.generate([context + conts[0]], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)[0]
    assert plain.num_cached_tokens == (len(context + conts[0]) - 1) // 16 * 16 > 0
    assert_pool_whole(llm)


def test_offline_under_preemption(default_model, smol_case):
    """Eight blocks for four requests that each grow to three: decodes preempt and recompute,
    and the prompt log-probabilities are still delivered once, whole."""
    context, conts, want = smol_case
    block_bytes = 30 * 2 * 3 * 64 * 4 * 16
    config = EngineConfig(model=ModelConfig(dtype="float32", quantization="none", max_model_len=64),
                          cache=CacheConfig(kv_cache_memory=8 * block_bytes / 2**30),
                          scheduler=SchedulerConfig(max_num_batched_tokens=16))
    llm = LLM.from_engine(build_engine(config, loaded=default_model))
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=1, prompt_logprobs=1)
    outs = llm.generate([context + c for c in conts], params, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    for out, cont, expected in zip(outs, conts, want):
        assert len(out.prompt_logprobs) == len(context) + len(cont)
        assert abs(sum(e.logprob for e in out.prompt_logprobs[len(context):]) - expected) < 1e-4
    assert_pool_whole(llm)


def lm_eval_payload(prompts: list[list[int]]) -> dict:
    """Exactly what lm-eval's local-completions sends for loglikelihood requests."""
    return {"model": "smollm2-135m", "prompt": prompts, "temperature": 0, "max_tokens": 1, "logprobs": 1,
            "seed": 1234, "echo": True}


def check_server(url: str, headers: dict, context, conts, want) -> None:
    def post(prompts):
        r = httpx.post(f"{url}/v1/completions", json=lm_eval_payload(prompts), headers=headers, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()

    ctxlen = len(context)
    sequential = [post([context + c])["choices"][0] for c in conts]
    batched = sorted(post([context + c for c in conts])["choices"], key=lambda c: c["index"])

    async def concurrent():
        async with httpx.AsyncClient(timeout=120) as client:
            rs = await asyncio.gather(*(client.post(f"{url}/v1/completions", headers=headers,
                                                    json=lm_eval_payload([context + c])) for c in conts))
        return [r.json()["choices"][0] for r in rs]

    for choices in (sequential, batched, asyncio.run(concurrent())):
        for choice, cont, expected in zip(choices, conts, want):
            tokens = choice["logprobs"]["token_logprobs"]
            assert len(tokens) == ctxlen + len(cont) + 1 and tokens[0] is None
            assert abs(lm_eval_sum(choice, ctxlen) - expected) < 1e-4


def test_server_lm_eval_requests(server, smol_case):
    """The session's server: prefix caching on, whole prompts in one step."""
    context, conts, want = smol_case
    check_server(server.url, server.headers, context, conts, want)
    r = httpx.post(f"{server.url}/v1/completions", headers=server.headers, timeout=60,
                   json={"model": "smollm2-135m", "prompt": context + conts[0], "max_tokens": 1})
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, "the blocks stay cached for others"
    scored = httpx.post(f"{server.url}/v1/completions", headers=server.headers, timeout=60,
                        json=lm_eval_payload([context + conts[0]]))
    assert scored.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_server_lm_eval_requests_chunked(tmp_path, smol_case):
    """A server whose step budget (16 tokens) is smaller than every prompt."""
    context, conts, want = smol_case
    srv = Server("--dtype", "float32", "--quantization", "none", "--kv-cache-memory", "0.5", "--max-num-batched-tokens", "16",
                 log=tmp_path / "server.log")
    try:
        check_server(srv.url, {}, context, conts, want)
    finally:
        srv.stop()


def test_disaggregated_prompt_logprobs(tiny_dir):
    """The prefill engine scores the prompt; the client gets the entries once, whole and in order."""
    path = tiny_dir(kind="llama")
    rng = random.Random(3)
    context = [rng.randrange(256) for _ in range(40)]
    conts = [[rng.randrange(256) for _ in range(n)] for n in (1, 3, 5, 2)]
    want = reference_sums(hf_model(path), context, conts)
    config = EngineConfig(model=ModelConfig(model=str(path), dtype="float32"),
                          cache=CacheConfig(kv_cache_memory=0.01, block_size=16),
                          scheduler=SchedulerConfig(max_num_batched_tokens=16))
    disagg = DisaggConfig(prefill_threads=1, decode_threads=1)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=1, prompt_logprobs=1)

    async def run_one(engine, i, ids):
        final = None
        async for out in engine.generate(ids, params, f"r{i}", strict_length=False):
            assert out.prompt_logprobs is None or len(out.prompt_logprobs) in (1, len(ids)), "never partial"
            final = out
        return final

    async def main():
        engine = AsyncEngine(config, disagg=disagg)
        await engine.start()
        try:
            sequential = [await run_one(engine, i, context + c) for i, c in enumerate(conts)]
            together = await asyncio.gather(*(run_one(engine, 10 + i, context + c) for i, c in enumerate(conts)))
            return sequential, together, await settled_stats(engine)
        finally:
            await engine.shutdown()

    sequential, together, stats = asyncio.run(main())
    for outs in (sequential, together):
        for out, cont, expected in zip(outs, conts, want):
            assert len(out.prompt_logprobs) == len(context) + len(cont)
            got = sum(e.logprob for e in out.prompt_logprobs[len(context):])
            assert abs(got - expected) < 1e-4, (got, expected)
            assert len(out.outputs[0].token_ids) == 3
    assert stats["prefill-0"].kv_cache_usage == 0 and stats["decode-0"].kv_cache_usage == 0
