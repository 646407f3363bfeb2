"""A rolling drain of every engine of a 2 prefill + 2 decode deployment under steady load.

    python benchmarks/rolling_drain.py --rate 1.0 --num-requests 80

One server (``--mode disaggregated --num-prefill-engines 2 --num-decode-engines 2``, an API key,
the default model), greedy requests of ``duoserve bench``'s random workload at Poisson
``--rate``. First the workload undisturbed; then the same workload again while each engine in
turn (prefill-0, prefill-1, decode-0, decode-1) is drained with an authenticated
``POST /v1/engines/{name}/drain`` and the next one waits until the drained engine is back
(a new pid in ``/v1/memory``). Reports failed requests, how many texts equal the undisturbed
run's, each drain's seconds until the engine was back, and the migrations the server counted,
as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time

import httpx

from _common import wait_healthy

KEY = "rolling-drain-key"
ENGINES = ("prefill-0", "prefill-1", "decode-0", "decode-1")


async def drain_each(base: str, wait_first: float) -> list[dict]:
    """Drain every engine in turn; each time until it is back under a new pid."""
    headers = {"Authorization": f"Bearer {KEY}"}
    drains = []
    async with httpx.AsyncClient(timeout=30, headers=headers) as client:
        await asyncio.sleep(wait_first)
        for name in ENGINES:
            before = (await client.get(f"{base}/v1/memory")).json()["engines"][name]["pid"]
            start = time.perf_counter()
            answer = await client.post(f"{base}/v1/engines/{name}/drain")
            held = answer.json().get("requests_held") if answer.status_code == 202 else None
            while True:
                await asyncio.sleep(0.2)
                engines = (await client.get(f"{base}/v1/memory")).json()["engines"]
                if name in engines and engines[name]["pid"] != before:
                    break
            drains.append({"engine": name, "status": answer.status_code, "requests_held": held,
                           "back_after_s": round(time.perf_counter() - start, 2)})
    return drains


def migrations(base: str) -> float:
    text = httpx.get(f"{base}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("duoserve:request_migrations_total"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=float, default=1.0)
    parser.add_argument("--num-requests", type=int, default=80)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--port", type=int, default=8750)
    args = parser.parse_args()
    from duoserve.bench.client import run
    from duoserve.bench.serve import load_tokenizer
    from duoserve.bench.workloads import build

    requests = build("random", load_tokenizer(None), args.num_requests, args.input_len, args.output_len, seed=3)
    base = f"http://127.0.0.1:{args.port}"
    server = subprocess.Popen([sys.executable, "-m", "duoserve.cli", "serve", "--port", str(args.port),
                               "--no-access-log", "--api-key", KEY, "--mode", "disaggregated",
                               "--num-prefill-engines", "2", "--num-decode-engines", "2"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_healthy(f"{base}/health", 180, lambda: server.poll() is None)

        def load():
            return run(base, "/v1/completions", "smollm2-135m", requests, args.rate, ignore_eos=True, api_key=KEY,
                       seed=1)

        undisturbed, _ = asyncio.run(load())

        async def disturbed():
            return await asyncio.gather(load(), drain_each(base, wait_first=2.0))

        (records, seconds), drains = asyncio.run(disturbed())
        same = sum(a.ok and b.ok and a.text == b.text for a, b in zip(undisturbed, records))
        report = {"rate": args.rate, "num_requests": len(records), "failed_undisturbed": sum(not r.ok for r in undisturbed),
                  "failed": sum(not r.ok for r in records), "texts_identical": same, "seconds": round(seconds, 1),
                  "drains": drains, "migrations": migrations(base),
                  "errors": sorted({r.error for r in records if r.error})}
        print(json.dumps(report, indent=2))
    finally:
        server.terminate()
        server.wait(90)


if __name__ == "__main__":
    main()
