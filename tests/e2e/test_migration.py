"""Requests that survive their engine: a colocated deployment of two engines (``--num-engines
2``, real processes) loses one mid-stream, killed or frozen; every stream it held goes on on
the other engine and ends with the tokens of an undisturbed run, greedy and seeded, with no
error and no token repeated or missing; the lost engine is relaunched and every pool ends
whole."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from duoserve import SamplingParams
from duoserve.config import CacheConfig, ClusterConfig, EngineConfig, ModelConfig
from duoserve.frontend.async_engine import AsyncEngine
from tests.disagg_helpers import assert_same, settled_stats

GREEDY = SamplingParams(temperature=0, max_tokens=300, ignore_eos=True, logprobs=2)
SEEDED = SamplingParams(temperature=0.9, top_p=0.9, seed=5, max_tokens=300, ignore_eos=True)
PAIR = SamplingParams(temperature=1.0, seed=9, n=2, max_tokens=300, ignore_eos=True)
# placed in turn on the less loaded engine (least-loaded routing: by prefix, each would follow its
# reference run's cached prompt): r0, r2, r4 on engine-0 (the one that goes down)
STREAMS = [("r0", GREEDY, list(range(1, 40))), ("r1", GREEDY, [3, 4, 5]), ("r2", SEEDED, list(range(50, 90))),
           ("r3", SEEDED, [9, 8, 7]), ("r4", PAIR, list(range(100, 120)))]


def config(path) -> EngineConfig:
    return EngineConfig(model=ModelConfig(model=str(path), dtype="float32"),
                        cache=CacheConfig(kv_cache_memory=0.01, block_size=16))


async def stream(engine: AsyncEngine, request_id: str, params: SamplingParams, prompt: list[int],
                 started: asyncio.Event | None = None) -> tuple[list, list[list[int]]]:
    """The final outputs, and each sample's tokens as the stream delivered them (deltas joined)."""
    final, delivered = None, [[] for _ in range(params.n)]
    async for out in engine.generate(prompt, params, request_id, strict_length=False):
        for i, sample in enumerate(out.outputs):
            delivered[i].extend(sample.delta_token_ids)
        if started is not None and min(len(s.token_ids) for s in out.outputs) >= 3:
            started.set()
        final = out
    return final.outputs, delivered


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "frozen"])
def test_the_streams_of_an_engine_that_goes_down_go_on_on_the_other(tiny_dir, how):
    migrations, resumes = [], []

    async def main():
        cluster = ClusterConfig(num_engines=2, routing="least-loaded")
        engine = AsyncEngine(config(tiny_dir(kind="llama")), cluster=cluster)
        engine.on_migrate.append(lambda *args: migrations.append(args))
        engine.on_resume.append(resumes.append)
        await engine.start()
        try:
            reference = [await stream(engine, f"ref-{rid}", params, prompt) for rid, params, prompt in STREAMS]
            doomed = engine.clients[0]
            first_pid = doomed.process.pid
            started = asyncio.Event()
            tasks = [asyncio.ensure_future(stream(engine, rid, params, prompt, started if rid == "r0" else None))
                     for rid, params, prompt in STREAMS]
            await asyncio.wait_for(started.wait(), 60)
            placed = {rid: p.decode for rid, p in engine.group.placements.items()}
            os.kill(first_pid, how)
            down_at = time.monotonic()
            results = await asyncio.wait_for(asyncio.gather(*tasks), 120)
            finished_in = time.monotonic() - down_at
            for _ in range(600):   # the lost engine is relaunched
                if engine.ready and doomed.process.pid != first_pid:
                    break
                await asyncio.sleep(0.1)
            return reference, placed, results, finished_in, doomed.process.pid != first_pid, await settled_stats(engine), \
                dict(engine.group.placements)
        finally:
            await engine.shutdown()

    reference, placed, results, finished_in, relaunched, stats, placements = asyncio.run(main())
    assert placed == {"r0": "engine-0", "r1": "engine-1", "r2": "engine-0", "r3": "engine-1", "r4": "engine-0"}
    for (rid, params, _), (want, _), (got, delivered) in zip(STREAMS, reference, results):
        assert [s.finish_reason for s in got] == ["length"] * params.n, rid
        assert [len(s.token_ids) for s in got] == [300] * params.n, rid
        assert [list(s.token_ids) for s in got] == delivered, f"{rid}: a token repeated or missing in the stream"
        if params.temperature == 0:
            assert_same(got, want)
        else:
            assert [s.token_ids for s in got] == [s.token_ids for s in want], f"{rid}: seeded draws differ"
    assert sorted(m[1] for m in migrations) == ["engine-0"] * 3
    assert {m[0] for m in migrations} == {"exited" if how == signal.SIGKILL else "unreachable"}
    assert len(resumes) == 3 and max(resumes) < 10
    assert relaunched and placements == {}
    assert set(stats) == {"engine-0", "engine-1"}
    assert all(s.kv_cache_usage == 0 and s.num_running == 0 for s in stats.values()), "every pool whole"
    print(f"{how!r}: streams finished {finished_in:.1f} s after the engine went down; resumed in "
          f"{', '.join(f'{r:.2f}' for r in resumes)} s")


def test_a_rolling_drain_of_both_engines_loses_nothing_and_moves_no_token(tiny_dir):
    """Each engine drained in turn under load (``AsyncEngine.drain_engine``, what ``POST
    /v1/engines/{name}/drain`` calls): new work goes to the other one at once, the drained one
    finishes every stream it holds (nothing migrates), stops, and is launched again; every stream
    ends with an undisturbed run's tokens."""
    migrations = []

    async def main():
        engine = AsyncEngine(config(tiny_dir(kind="llama")), cluster=ClusterConfig(num_engines=2))
        engine.on_migrate.append(lambda *args: migrations.append(args))
        await engine.start()
        try:
            reference = [await stream(engine, f"ref-{rid}", params, prompt) for rid, params, prompt in STREAMS]
            late_reference = await stream(engine, "ref-late", GREEDY, list(range(7, 30)))
            placed, relaunched, results = {}, [], []
            for client in engine.clients:   # a rolling restart: one engine, then the other
                started = asyncio.Event()
                tasks = [asyncio.ensure_future(stream(engine, f"{client.name}-{rid}", params, prompt,
                                                      started if rid == "r0" else None))
                         for rid, params, prompt in STREAMS]
                await asyncio.wait_for(started.wait(), 60)
                first_pid = client.process.pid
                engine.drain_engine(client.name)
                with pytest.raises(ValueError, match="drains already"):
                    engine.drain_engine(client.name)
                late = asyncio.ensure_future(stream(engine, f"{client.name}-late", GREEDY, list(range(7, 30))))
                await asyncio.sleep(0)
                placed[f"{client.name}-late"] = engine.group.placements[f"{client.name}-late"].decode
                results += await asyncio.wait_for(asyncio.gather(*tasks, late), 120)
                for _ in range(600):   # drained, stopped, launched again
                    if engine.ready and client.process.pid != first_pid and not client.draining:
                        break
                    await asyncio.sleep(0.1)
                relaunched.append(client.process.pid != first_pid)
            with pytest.raises(KeyError):
                engine.drain_engine("engine-9")
            return reference + [late_reference], placed, relaunched, results, await settled_stats(engine)
        finally:
            await engine.shutdown()

    reference, placed, relaunched, results, stats = asyncio.run(main())
    assert placed == {"engine-0-late": "engine-1", "engine-1-late": "engine-0"}, "new work avoids a draining engine"
    assert relaunched == [True, True] and migrations == []
    expected = [*reference[:-1], reference[-1]] * 2
    for (want, _), (got, delivered) in zip(expected, results):
        assert [list(s.token_ids) for s in got] == delivered
        assert [s.token_ids for s in got] == [s.token_ids for s in want]
    assert all(s.kv_cache_usage == 0 and s.num_running == 0 for s in stats.values()), "every pool whole"
