"""The same disaggregated engines through Ray (`--cluster ray`) and launched locally, and
how long a decode node's death takes to heal.

    python benchmarks/ray_vs_local.py --rate 0.28 --num-requests 30

Workload and client: the disaggregation benchmark's (``disagg_vs_colocated.py``: 80 % short
prompts of 64 tokens, 20 % long ones of 1,500, 128 output tokens, Poisson arrivals at
``--rate``, the same seed for every setup), one prefill and one decode engine of one thread
each. Setups: ``local-pinned`` (the disaggregation benchmark's: prefill on core 0, decode on
core 1), ``local`` (not pinned: as Ray runs them) and ``ray`` (a Ray cluster of three nodes
on this host, ``ray.cluster_utils.Cluster``: a head, a node with ``duoserve_prefill`` and
one with ``duoserve_decode``, 1 CPU each). Then, with a request sent every 0.25 s to the Ray
server, the decode node is removed and a new one added at once: reported are the seconds
until the requests on the dead engine failed and until the first request served by its
replacement. Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time

import httpx

from _common import wait_healthy
from disagg_vs_colocated import add_workload_args, drive, workload

ENGINES = ["--mode", "disaggregated", "--prefill-device", "cpu", "--prefill-threads", "1", "--decode-threads", "1"]
SETUPS = {"local-pinned": [*ENGINES, "--prefill-cpus", "0", "--decode-cpus", "1"], "local": ENGINES, "ray": ENGINES}


def serve(flags: list[str], port: int) -> tuple[subprocess.Popen, float]:
    cmd = [sys.executable, "-m", "duoserve.cli", "serve", "--port", str(port), "--no-access-log",
           "--max-model-len", "2048", *flags]
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    healthy_after = wait_healthy(f"http://127.0.0.1:{port}/health", 600, lambda: server.poll() is None)
    return server, healthy_after


def heal(cluster, nodes: dict, port: int) -> dict:
    """A request every 0.25 s; the decode node removed, a new one added: failure and recovery times."""
    url = f"http://127.0.0.1:{port}/v1/completions"
    body = {"model": "smollm2-135m", "prompt": "The capital of France is", "max_tokens": 64, "ignore_eos": True}
    log: list[tuple[float, float, int]] = []   # (sent, answered, status)
    stop = threading.Event()

    def one() -> None:
        sent = time.monotonic()
        try:
            status = httpx.post(url, json=body, timeout=120).status_code
        except httpx.HTTPError:
            status = 0
        log.append((sent, time.monotonic(), status))

    def load() -> None:
        while not stop.is_set():
            threading.Thread(target=one, daemon=True).start()
            time.sleep(0.25)

    loader = threading.Thread(target=load, daemon=True)
    loader.start()
    time.sleep(5)
    removed_at = time.monotonic()
    cluster.remove_node(nodes["decode"])
    nodes["decode"] = cluster.add_node(num_cpus=1, resources={"duoserve_decode": 1})
    deadline = removed_at + 300
    while time.monotonic() < deadline and not any(s == 200 and sent > removed_at for sent, _, s in log):
        time.sleep(0.1)
    stop.set()
    failed = [answered - removed_at for sent, answered, s in log if s != 200 and sent < removed_at]
    served = [answered - removed_at for sent, answered, s in log if s == 200 and sent > removed_at]
    return {"in_flight_failed_within_s": round(max(failed), 2) if failed else None,
            "num_failed_in_flight": len(failed),
            "first_success_after_s": round(min(served), 2) if served else None,
            "refused_meanwhile": sum(1 for sent, _, s in log if sent > removed_at and s != 200)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(parser, rate=0.28, num_requests=30)
    parser.add_argument("--setups", default=",".join(SETUPS))
    args = parser.parse_args()
    import ray
    from ray.cluster_utils import Cluster

    from duoserve.bench.serve import load_tokenizer

    requests = workload(args, load_tokenizer(None))
    results: dict = {"rate": args.rate, "num_requests": args.num_requests}
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    nodes = {"prefill": cluster.add_node(num_cpus=1, resources={"duoserve_prefill": 1}),
             "decode": cluster.add_node(num_cpus=1, resources={"duoserve_decode": 1})}
    ray_flags = ["--cluster", "ray", "--ray-address", cluster.address, "--ray-namespace", "bench"]
    try:
        for i, name in enumerate(args.setups.split(",")):
            port = 8750 + i
            server, healthy_after = serve(SETUPS[name] + (ray_flags if name == "ray" else []), port)
            try:
                results[name] = {"healthy_after_s": round(healthy_after, 1), **drive(port, requests, args)}
                print(name, json.dumps(results[name]), file=sys.stderr, flush=True)
                if name == "ray":
                    results["ray_node_death"] = heal(cluster, nodes, port)
                    print("node death", json.dumps(results["ray_node_death"]), file=sys.stderr, flush=True)
            finally:
                server.terminate()
                server.wait(60)
    finally:
        subprocess.run([sys.executable, "-m", "duoserve.cli", "ray-stop", "--ray-address", cluster.address,
                        "--ray-namespace", "bench"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        ray.shutdown()
        cluster.shutdown()
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
