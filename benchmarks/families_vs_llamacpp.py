"""The model families' real GGUF files served by duoserve and by llama.cpp's server, one client for both.

    python benchmarks/fetch_models.py
    python benchmarks/families_vs_llamacpp.py --llama-server PATH/llama-server \\
        --gguf ~/models/gemma-3-270m-q4_k_m.gguf [--max-model-len 4096]

Each server runs alone, started and stopped here, on the same file with duoserve's defaults
(blocks, fast mode) and llama.cpp's (2 threads, a slot per stream). The client is ``duoserve bench
serve`` (random 128-token prompts counted with the file's tokenizer, 128 output tokens,
``--ignore-eos``) at 1 and 16 concurrent streams. Also recorded: seconds to a healthy server and
the peak resident memory of the server's process tree: the sum of its processes' RSS (pages two
processes share counted in both) and of their PSS (each page once), with each process's PSS at
that peak. Prints one JSON document.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from serve_vs_peers import Running


def bench(server: Running, gguf: str, concurrency: int, num_prompts: int) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        subprocess.run([sys.executable, "-m", "duoserve", "bench", "serve", "--base-url", f"http://127.0.0.1:{server.port}",
                        "--tokenizer", gguf, "--input-len", "128", "--output-len", "128", "--ignore-eos",
                        "--num-prompts", str(num_prompts), "--max-concurrency", str(concurrency),
                        "--result-json", out.name, "--quiet"], check=True)
        server.sample_memory()
        result = json.loads(Path(out.name).read_text())
    return result


def summary(result: dict) -> dict:
    return {"output_tok_s": round(result["output_throughput"], 2), "tpot_p50_ms": round(result["tpot_ms"]["p50"], 1),
            "ttft_p50_ms": round(result["ttft_ms"]["p50"], 1), "ttft_p99_ms": round(result["ttft_ms"]["p99"], 1),
            "completed": result["completed"], "failed": result["failed"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama-server", required=True)
    parser.add_argument("--gguf", required=True)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--single-prompts", type=int, default=8)
    parser.add_argument("--batch-prompts", type=int, default=16)
    parser.add_argument("--only", default="duoserve,llamacpp")
    args = parser.parse_args()
    servers = {
        "duoserve": (["duoserve", "serve", "--model", args.gguf, "--port", "8302",
                      "--max-model-len", str(args.max_model_len)], 8302),
        "llamacpp": ([args.llama_server, "-m", args.gguf, "--port", "8303", "-t", "2", "-np", "16",
                      "-c", str(16 * args.max_model_len // 4)], 8303),
    }
    results: dict = {"gguf": args.gguf}
    for name in args.only.split(","):
        cmd, port = servers[name]
        server = Running(cmd, port)
        try:
            results[name] = {"startup_s": round(server.startup_s, 1),
                             "c1": summary(bench(server, args.gguf, 1, args.single_prompts)),
                             "c16": summary(bench(server, args.gguf, 16, args.batch_prompts)),
                             "peak_rss_mb": round(server.peak_kb / 1024), "peak_pss_mb": round(server.peak_pss_kb / 1024),
                             "pss_by_process_mb": {k: round(v / 1024) for k, v in server.peak_pss_by_process.items()}}
        finally:
            server.stop()
    if "duoserve" in results and "llamacpp" in results:
        ours, peer = results["duoserve"], results["llamacpp"]
        results["ratios"] = {run: {k: round(ours[run][k] / peer[run][k], 2) for k in ours[run]
                                   if isinstance(ours[run][k], float) and peer[run].get(k)} for run in ("c1", "c16")}
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
