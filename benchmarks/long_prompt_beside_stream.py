"""What a long prompt's first token costs where it shares the cores with decodes: one server of a
setup (``disagg_vs_colocated.SETUPS``), a 1,500-token prompt with ``max_tokens`` 1 alone
(three times), then once while ``--streams`` other streams decode 400 tokens each; reports the
prompt's TTFT both ways, the streams' median and longest gap between tokens (the longest: a
colocated chunk step, or a turn of the disaggregated setups) and the server's CPU seconds over
the part beside the streams.

    python benchmarks/long_prompt_beside_stream.py --setups colocated,disagg-auto
    python benchmarks/long_prompt_beside_stream.py --setups colocated,disagg-auto --streams 10
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import threading
import time

import httpx
from _common import DuoserveServer
from disagg_vs_colocated import SETUPS


def random_prompt(num_tokens: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 40000) for _ in range(num_tokens)]


def token_times(url: str, num_tokens: int, seed: int, max_tokens: int) -> list[float]:
    """Seconds from the request to each streamed token."""
    start, times = time.perf_counter(), []
    body = {"model": "smollm2-135m", "prompt": random_prompt(num_tokens, seed), "max_tokens": max_tokens,
            "stream": True, "ignore_eos": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                times.append(time.perf_counter() - start)
    return times


def measure(name: str, args, port: int) -> dict:
    server = DuoserveServer(SETUPS[name], port)
    url = server.url
    try:
        for seed in range(4):   # warm both engines and let them measure their rates
            token_times(url, args.long_len if seed == 0 else 64, 100 + seed, 4)
        alone = [token_times(url, args.long_len, seed, 1)[0] for seed in range(3)]
        streams: list[list[float]] = [[] for _ in range(args.streams)]
        decoding = [threading.Thread(target=lambda times=times, i=i: times.extend(token_times(url, 64, 7 + i, 400)))
                    for i, times in enumerate(streams)]
        cpu_before = server.cpu_seconds()
        for thread in decoding:
            thread.start()
        time.sleep(1.0)   # the streams are decoding
        beside = token_times(url, args.long_len, 50, 1)[0]
        for thread in decoding:
            thread.join()
        gaps = [b - a for times in streams for a, b in zip(times, times[1:])]
        return {"long_alone_s": statistics.median(alone), "long_beside_streams_s": beside,
                "stream_gap_p50_ms": 1000 * statistics.median(gaps), "stream_gap_max_ms": 1000 * max(gaps),
                "cpu_s_beside": round(server.cpu_seconds() - cpu_before, 1)}
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--setups", default="colocated,disagg-auto")
    parser.add_argument("--long-len", type=int, default=1500)
    parser.add_argument("--streams", type=int, default=1, help="streams decoding beside the long prompt")
    args = parser.parse_args()
    for i, name in enumerate(args.setups.split(",")):
        print(name, json.dumps(measure(name, args, 8750 + i)), flush=True)


if __name__ == "__main__":
    main()
