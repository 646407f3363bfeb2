"""Where one engine step's time goes: linear layers, decode or prefill attention, KV writes, sampling.

    python benchmarks/step_profile.py --dtype float32 --batch 32
    python benchmarks/step_profile.py --dtype bfloat16 --prefill

Runs the eager model (timers cannot see inside a compiled graph) with a timer wrapped
around each part, after prefilling 128-token prompts; prints milliseconds per step.
``--prefill``: one step that prefills four 128-token prompts instead.
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prefill", action="store_true")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--quantization", default="none", choices=["none", "gguf", "int8"])
    parser.add_argument("--gguf-mode", default="fast", choices=["fast", "exact"])
    args = parser.parse_args()

    import duoserve.kernels.attention as c_attention
    import duoserve.kernels.linear as linear
    import duoserve.model.attention as attention
    from duoserve import LLM, SamplingParams
    from duoserve.core.request import Request

    seconds: dict[str, float] = collections.defaultdict(float)

    def timed(name, fn):
        def wrapper(*a, **k):
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                seconds[name] += time.perf_counter() - start
        return wrapper

    c_attention.c_decode_attention = timed("decode attention", c_attention.c_decode_attention)
    attention._prefill_attention = timed("prefill attention", attention._prefill_attention)
    attention.write_kv = timed("KV writes", attention.write_kv)
    c_attention.write_kv = timed("KV writes", c_attention.write_kv)
    linear.CPULinear.forward = timed("linear layers", linear.CPULinear.forward)
    linear.GGUFLinear.forward = timed("linear layers", linear.GGUFLinear.forward)
    linear.GGUFEmbedding.forward = timed("embedding", linear.GGUFEmbedding.forward)
    linear.Int8Linear.forward = timed("linear layers", linear.Int8Linear.forward)
    engine = LLM(dtype=args.dtype, kv_cache_memory=1.0, num_threads=2,
                 enable_prefix_caching=False, quantization=args.quantization, gguf_mode=args.gguf_mode).engine
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=1 if args.prefill else 400, ignore_eos=True)
    batch = 4 if args.prefill else args.batch

    def add(tag: str) -> None:
        for i in range(batch):
            prompt = [rng.randrange(1000, 40000) for _ in range(128)]
            engine.add_request(Request(f"{tag}-{i}", prompt, params, (), 4096))

    def one_step(n: int) -> float:
        if args.prefill:
            add(f"prefill{n}")
        start = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - start
        if args.prefill:
            for request_id in list(engine.scheduler.requests):
                engine.release(request_id)
        return elapsed

    if args.prefill:
        one_step(-1)  # warm-up
    else:
        add("decode")
        while any(r.num_output_tokens == 0 for r in engine.scheduler.requests.values()):
            engine.step()
        for _ in range(3):
            engine.step()
    counted = 3 if args.prefill else args.steps
    seconds.clear()
    total = sum(one_step(n) for n in range(counted))
    result = {"dtype": args.dtype, "quantization": args.quantization, "step": "prefill 4 x 128" if args.prefill else f"decode, batch {batch}",
              "step_ms": round(total / counted * 1000, 2)}
    result.update({name: round(value / counted * 1000, 2) for name, value in seconds.items()})
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
