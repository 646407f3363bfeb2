"""Median decode-step times of an engine, in this process: batch 1 and 32, greedy and temperature 1.

    python benchmarks/step_times.py --dtype float32
    python benchmarks/step_times.py --model ~/models/gemma-3-270m-q4_k_m.gguf --max-model-len 4096
    git worktree add ../duoserve-old REV && PYTHONPATH=../duoserve-old python benchmarks/step_times.py

Prompts of 128 random tokens, 64 new tokens each; the median step after the prefills, the
median prefill step (128 prompt tokens at batch 1, 512 at batch 32), and tokens per second
over the whole batch (prefill included). Works against older checkouts
too (only the public LLM API and EngineCore.step are used), for before/after tables.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quantization", default=None, choices=["none", "gguf", "int8"],
                        help="passed on when given (older checkouts have no such option; the default "
                             "model is a GGUF file, which now defaults to gguf)")
    parser.add_argument("--gguf-mode", default=None, choices=["fast", "exact"])
    parser.add_argument("--kv-cache-dtype", default=None, choices=["float32", "bfloat16"])
    parser.add_argument("--model", default=None, help="a model path (default: the packaged default model)")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--batches", default="1,32", help="comma-separated batch sizes")
    parser.add_argument("--temperatures", default="0,1", help="comma-separated temperatures")
    args = parser.parse_args()

    import duoserve
    from duoserve import LLM, SamplingParams
    from duoserve.core.request import Request

    extra = {k: v for k, v in (("quantization", args.quantization), ("gguf_mode", args.gguf_mode),
                               ("kv_cache_dtype", args.kv_cache_dtype), ("model", args.model),
                               ("max_model_len", args.max_model_len), ("compile", args.compile)) if v}
    engine = LLM(dtype=args.dtype, kv_cache_memory=1.0, num_threads=args.threads, **extra).engine
    rng = random.Random(0)

    def run(batch: int, temperature: float) -> tuple[float, float, float]:
        params = SamplingParams(temperature=temperature, max_tokens=64, ignore_eos=True)
        for i in range(batch):
            prompt = [rng.randrange(1000, 40000) for _ in range(128)]
            engine.add_request(Request(f"b{batch}-t{temperature}-{i}", prompt, params, (), 4096))
        steps, start = [], time.perf_counter()
        while engine.has_unfinished():
            t = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - t)
        total = time.perf_counter() - start
        for request_id in list(engine.scheduler.requests):
            engine.release(request_id)
        num_prefill_steps = -(-batch * 128 // 512)
        prefill_ms = statistics.median(steps[:num_prefill_steps]) * 1000  # a step of up to 512 prompt tokens
        return statistics.median(steps[num_prefill_steps + 2:]) * 1000, batch * 64 / total, prefill_ms

    run(2, 0.0)  # warm-up
    result = {"checkout": duoserve.__file__.rsplit("/duoserve/", 1)[0], "dtype": args.dtype, **extra}
    for batch in map(int, args.batches.split(",")):
        for temperature in map(float, args.temperatures.split(",")):
            step_ms, tok_s, prefill_ms = run(batch, temperature)
            result[f"batch {batch}, T{temperature:g}"] = {"median_step_ms": round(step_ms, 2), "tok_s": round(tok_s, 1),
                                                           "median_prefill_step_ms": round(prefill_ms, 1)}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
