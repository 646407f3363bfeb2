"""One sequence's decode step against its linear layers alone: what a step costs beyond the weights.

    python benchmarks/step_vs_linears.py --dtype float32     # then bfloat16
    python benchmarks/step_vs_linears.py --dtype bfloat16 --prefill

The default model's dense weights, compiled, 2 threads, one greedy sequence after a 128-token
prompt. Timed in one process, alternated: the whole ``EngineCore.step``, the compiled forward
(``runner.forward``), the output projection (``compute_logits``), and a sweep of the same
engine's 121 packed linear layers called one after another at one row (the weights the step
reads, from memory, with nothing between them: the step's floor on this machine). Medians in
ms, as JSON.

``--prefill``: a step of four fresh 128-token prompts (512 rows, the default token budget)
against the same sweep at 512 rows (the output projection at the 4 rows a step samples): a
prompt step is compute-bound, so this is its floor at the kernels' measured rate.
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
    parser.add_argument("--rounds", type=int, default=3, help="sequences of 100 tokens each (prefill: 10 steps)")
    parser.add_argument("--prefill", action="store_true", help="prompt steps of 4 x 128 tokens instead")
    args = parser.parse_args()
    import torch

    from duoserve import LLM, SamplingParams
    from duoserve.core.request import Request
    from duoserve.kernels.linear import CPULinear

    dtype = getattr(torch, args.dtype)
    engine = LLM(dtype=args.dtype, quantization="none", kv_cache_memory=1.0, num_threads=2).engine
    runner = engine.runner
    linears = [m for m in runner.model.modules() if isinstance(m, CPULinear) and m.packed is not None]
    if not linears:
        raise SystemExit("no packed linear layers on this CPU (csrc/packed_linear.c): nothing to compare")
    times: dict[str, list[float]] = {"step": [], "forward": [], "output projection": [], "linear layers alone": []}

    def timed(name, fn):
        def wrapper(*a):
            start = time.perf_counter()
            out = fn(*a)
            times[name].append(time.perf_counter() - start)
            return out
        return wrapper

    runner.forward = timed("forward", runner.forward)
    runner.model.compute_logits = timed("output projection", runner.model.compute_logits)
    vocab = engine.arch.vocab_size
    width = 512 if args.prefill else 1
    rows = {(m.in_features, m.out_features == vocab): torch.randn(4 if m.out_features == vocab and args.prefill
                                                                 else width, m.in_features).to(dtype)
            for m in linears}
    op = torch.ops.duoserve.packed_linear

    def sweep() -> None:
        start = time.perf_counter()
        for m in linears:
            op(rows[m.in_features, m.out_features == vocab], m.packed, m.bias, m.out_features)
        times["linear layers alone"].append(time.perf_counter() - start)

    rng = random.Random(0)

    def one_sequence(tokens: int) -> None:
        params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
        engine.add_request(Request(f"s{rng.random()}", [rng.randrange(1000, 40000) for _ in range(128)], params,
                                   (), 4096))
        steps = 0
        while engine.has_unfinished():
            start = time.perf_counter()
            engine.step()
            times["step"].append(time.perf_counter() - start)
            steps += 1
            if steps > 2:   # past the prefill
                sweep()
        for request_id in list(engine.scheduler.requests):
            engine.release(request_id)

    def prompt_steps(count: int) -> None:
        params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        for _ in range(count):
            for _ in range(4):
                engine.add_request(Request(f"p{rng.random()}", [rng.randrange(1000, 40000) for _ in range(128)],
                                           params, (), 4096))
            start = time.perf_counter()
            engine.step()   # the four prompts whole: 512 tokens, the default budget
            times["step"].append(time.perf_counter() - start)
            while engine.has_unfinished():
                engine.step()
            for request_id in list(engine.scheduler.requests):
                engine.release(request_id)
            sweep()

    if args.prefill:
        prompt_steps(3)   # warm-up
    else:
        one_sequence(10)
    for values in times.values():
        values.clear()
    for _ in range(args.rounds):
        if args.prefill:
            prompt_steps(10)
        else:
            one_sequence(100)
    result = {"dtype": args.dtype, "rows": width, **{name: round(statistics.median(v) * 1000, 2) for name, v in times.items()}}
    result["step over linear layers alone"] = round(result["step"] / result["linear layers alone"], 3)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
