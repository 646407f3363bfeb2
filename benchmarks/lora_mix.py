"""Many adapters, one model: output tokens a second with 16 streams spread over four rank-16 LoRA
adapters, against the base model alone at 16 streams, on the same server build and files.

    python benchmarks/lora_mix.py [--num-prompts 64] [--rounds 2]

The adapters are seeded random PEFT adapters (rank 16, alpha 32, q/k/v/o and gate/up/down) made
once with PEFT on what transformers reads from the packaged GGUF file, kept in ~/lora-bench. Each
round, side by side: ``duoserve serve`` with no flags, then with ``--lora-modules a=... d=...``;
``duoserve bench serve`` sends 64 random prompts (128 tokens in, 128 out, eos ignored) 16 at
once, to the base on the first server, and to the adapters in turn on the second (and to its
base too: what turning adapters on costs a base request). Prints one JSON document.

``--llama-server PATH --lora-ggufs A.gguf B.gguf C.gguf D.gguf`` (the same adapters converted with
llama.cpp's ``convert_lora_to_gguf.py``) adds the peer, side by side in each round: llama-server
on the same GGUF file, 16 slots, its threads the cores, the same workload (``Connection: close``)
to the base, then to the four adapters in turn by its per-request ``lora`` field (the adapters
loaded with ``--lora-init-without-apply``: none applies unless a request asks).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from _common import DuoserveServer

PORT = 8341
NAMES = ("a", "b", "c", "d")


def make_adapters(root: Path) -> dict[str, Path]:
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model

    from duoserve.model.loader import default_model_path

    paths = {name: root / name for name in NAMES}
    if all((p / "adapter_model.safetensors").exists() for p in paths.values()):
        return paths
    path = default_model_path()
    for seed, (name, out) in enumerate(paths.items()):
        model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                                  dtype=torch.float32)
        peft_model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=[
            "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for key, param in peft_model.named_parameters():
                if "lora_" in key:
                    param.copy_(torch.randn(param.shape, generator=generator) * 0.01)
        peft_model.save_pretrained(out)
    return paths


def bench(url: str, models: list[str] | None, args: argparse.Namespace, out: Path) -> float:
    command = [sys.executable, "-m", "duoserve.cli", "bench", "serve", "--base-url", url, "--num-prompts",
               str(args.num_prompts), "--max-concurrency", "16", "--input-len", "128", "--output-len", "128",
               "--ignore-eos", "--quiet", "--result-json", str(out)]
    if models:
        command += ["--lora-modules", *models]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    result = json.loads(out.read_text())
    assert not result.get("errors"), result.get("errors")
    return result["output_throughput"]


def llama_cpp(args: argparse.Namespace) -> dict:
    """llama-server's output tok/s, base and the four adapters in turn, on the same workload."""
    from duoserve.bench import workloads
    from duoserve.bench.client import run
    from duoserve.bench.serve import load_tokenizer
    from duoserve.model.loader import default_model_path

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [args.llama_server, "-m", str(default_model_path()), "--port", str(port), "-np", "16", "-c", "8192",
               "-t", str(os.cpu_count()), "--lora-init-without-apply"]
    for path in args.lora_ggufs:
        command += ["--lora", path]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline and server.poll() is None, "llama-server did not start"
            time.sleep(0.2)
        requests = workloads.build("random", load_tokenizer(None), args.num_prompts, 128, 128, 0.0, 0, 0, 1)
        found = {}
        for label, extra in (("base_tok_s", None), ("four_adapters_tok_s", [
                {"lora": [{"id": i, "scale": 1.0 if i == j else 0.0} for i in range(len(args.lora_ggufs))]}
                for j in range(len(args.lora_ggufs))])):
            records, seconds = asyncio.run(run(url, "/v1/completions", "smollm2", requests, float("inf"),
                                               max_concurrency=16, ignore_eos=True, extra_body=extra,
                                               headers={"Connection": "close"}))
            failed = [r.error for r in records if not r.ok]
            assert not failed, failed[:3]
            found[label] = sum(r.output_tokens for r in records) / seconds
        return found
    finally:
        server.terminate()
        server.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--llama-server", default=None, help="llama.cpp's llama-server: the peer, side by side")
    parser.add_argument("--lora-ggufs", nargs="*", default=[], help="the four adapters as llama.cpp GGUF files")
    args = parser.parse_args()
    adapters = make_adapters(Path(os.path.expanduser("~/lora-bench")))
    work = Path(os.path.expanduser("~/lora-bench/results"))
    work.mkdir(parents=True, exist_ok=True)
    rounds = []
    for i in range(args.rounds):
        server = DuoserveServer([], PORT)
        try:
            base = bench(server.url, None, args, work / f"base-{i}.json")
        finally:
            server.stop()
        server = DuoserveServer(["--lora-modules", *[f"{n}={p}" for n, p in adapters.items()]], PORT)
        try:
            mixed = bench(server.url, list(NAMES), args, work / f"mixed-{i}.json")
            base_beside = bench(server.url, None, args, work / f"base-beside-{i}.json")
        finally:
            server.stop()
        rounds.append({"base_tok_s": base, "four_adapters_tok_s": mixed, "base_with_adapters_loaded_tok_s": base_beside,
                       "ratio": mixed / base})
        if args.llama_server:
            peer = llama_cpp(args)
            rounds[-1].update({f"llamacpp_{k}": v for k, v in peer.items()})
            rounds[-1]["four_adapters_vs_llamacpp_four_adapters"] = mixed / peer["four_adapters_tok_s"]
    print(json.dumps({"rounds": rounds, "median_ratio": statistics.median(r["ratio"] for r in rounds)}, indent=2))


if __name__ == "__main__":
    main()
