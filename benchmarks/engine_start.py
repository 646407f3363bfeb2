"""Seconds from starting an engine process to its EngineReady, as the test suite starts them.

A tiny seeded Llama checkpoint (the tests' shape), eager, 10 MB of KV; each start launches the
engine the way a frontend does (``duoserve.frontend.launcher.spawn_engine``), waits for its
ready message, then stops it. ``--context forkserver`` (what duoserve does) forks engines off a
server that imported torch and the engine's code once; ``--context spawn`` (what it did before)
starts a fresh interpreter per engine. The first start of a run includes the fork server's own.

    python benchmarks/engine_start.py --starts 9 --context forkserver
    python benchmarks/engine_start.py --starts 9 --context spawn
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


async def one_start(path: Path) -> float:
    from duoserve.config import CacheConfig, EngineConfig, ModelConfig
    from duoserve.frontend.engine_client import EngineClient
    from duoserve.frontend.launcher import _ipc_address
    from duoserve.frontend.supervisor import start_engine, stop_engine

    config = EngineConfig(model=ModelConfig(model=str(path), dtype="float32"), cache=CacheConfig(kv_cache_memory=0.01),
                          num_threads=1)
    client = EngineClient("engine-0", _ipc_address("engine-0"), config)
    begin = time.perf_counter()
    await start_engine(client)
    seconds = time.perf_counter() - begin
    await stop_engine(client)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--starts", type=int, default=9)
    parser.add_argument("--context", choices=["forkserver", "spawn"], default="forkserver")
    args = parser.parse_args()
    from duoserve.frontend import launcher
    from tests.helpers import make_tiny_checkpoint

    if args.context == "spawn":
        launcher.engine_process_context = lambda: multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        make_tiny_checkpoint(Path(tmp), "llama")
        times = [asyncio.run(one_start(Path(tmp))) for _ in range(args.starts)]
    print(json.dumps({"context": args.context, "starts": args.starts, "first_s": round(times[0], 3),
                      "median_s": round(statistics.median(times), 3),
                      "median_after_first_s": round(statistics.median(times[1:]), 3) if len(times) > 1 else None,
                      "all_s": [round(t, 3) for t in times]}))


if __name__ == "__main__":
    main()
