"""Shared by the disaggregation tests: prompts, sampling settings, a reference, a comparison."""

from __future__ import annotations

import asyncio
import random
import time

import torch

from duoserve import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
SEEDED = SamplingParams(temperature=0.9, top_p=0.9, seed=21, max_tokens=16, ignore_eos=True)


def prompts() -> list[list[int]]:
    rng = random.Random(8)
    shared = [rng.randrange(256) for _ in range(35)]
    return ([[rng.randrange(256) for _ in range(n)] for n in (1, 6, 17, 40, 100)]
            + [shared + [5], shared + [6, 7], list(shared + [5])])


STAGE_METRICS: list[dict] = []   # the final metrics of every request of the last run


async def generate_all(engine, items, params, ids: str = "r") -> list:
    """Each item generated in turn, as request ``{ids}{i}``."""
    async def one(i, prompt):
        final = None
        async for out in engine.generate(prompt, params, f"{ids}{i}", strict_length=False):
            final = out
        STAGE_METRICS.append(final.metrics)
        return final.outputs[0]

    results = []
    for i, prompt in enumerate(items):  # the repeated prefix must be computed before it can hit
        results.append(await one(i, prompt))
    return results


def colocated_reference(path) -> list[list]:
    """Greedy and seeded outputs of one colocated engine, computed like the engines
    (one thread: matmul sums in the same order)."""
    threads = torch.get_num_threads()
    try:
        llm = LLM(str(path), dtype="float32", kv_cache_memory=0.01, num_threads=1)
        return [[o.outputs[0] for o in llm.generate(prompts(), p, use_tqdm=False)] for p in (GREEDY, SEEDED)]
    finally:
        torch.set_num_threads(threads)


def assert_same(got, want) -> None:
    """Identical tokens; for greedy, a first divergence is accepted only at a near-tie (gap < 1e-3)."""
    for g, w in zip(got, want):
        for i, (a, b) in enumerate(zip(g.token_ids, w.token_ids)):
            if a != b:
                assert w.logprobs is not None, f"sampled tokens differ at {i}: {a} vs {b}"
                top = w.logprobs[i].top
                assert top[0][1] - top[1][1] < 1e-3, f"token {i} differs ({a} vs {b}) away from a tie"
                print(f"near-tie divergence at token {i}, accepted")
                break
        else:
            assert len(g.token_ids) == len(w.token_ids)


def joined_in_process(prefill, decode):
    """A prefill and a decode engine joined by one in-process connector."""
    from duoserve.kv.connector import InProcessConnector

    link = InProcessConnector()
    prefill.attach_connector(link)
    decode.attach_connector(link)
    return prefill, decode


async def settled_stats(engine, guard: float = 120.0) -> dict:
    """The engines' stats once every engine that is up has sent a message after this call with
    nothing running or waiting there: what they counted up to now (they send stats once a
    second, and at once when their load changes). ``guard`` only turns a hang into a failure."""
    stale = {name: id(stats) for name, stats in engine.stats.items()}
    deadline = time.monotonic() + guard
    while True:
        stats = dict(engine.stats)
        up = [c.name for c in engine.clients if c.is_up()]
        if all(n in stats and id(stats[n]) != stale.get(n) and stats[n].num_running == 0
               and stats[n].num_waiting == 0 for n in up):
            return stats
        assert time.monotonic() < deadline, f"no fresh, settled stats from every engine up after {guard:g}s"
        await asyncio.sleep(0.02)
