"""Decode steps before and after a change, paired.

    python benchmarks/step_ab.py --dtype bfloat16                          # guard-free step
    python benchmarks/step_ab.py --dtype bfloat16 --change packed-linear   # packed linears
    python benchmarks/step_ab.py --dtype float32 --change native-attention # attention op in C++
    python benchmarks/step_ab.py --dtype float32 --change cpp-wrapper      # Inductor's C++ wrapper
    python benchmarks/step_ab.py --dtype float32 --change decode-step --batches 1,4,8,16,32
    python benchmarks/step_ab.py --dtype bfloat16 --change decode-step --quantization gguf --batches 1,16
    python benchmarks/step_ab.py --change compile --quantization gguf --batches 1,16 [--model FILE]

Two engines in one process (the default model's dense weights, compiled, 2 threads), their
steps alternated so that the machine's drift hits both alike; "after" is the default engine.
``guard-free-step``: "before" checks Dynamo's guards at every step
(``DUOSERVE_COMPILED_GUARDS=1``) and runs a decode step's attention from Python (write_kv,
then the C kernel through ctypes). ``packed-linear``: "before" keeps the plain weights
(``DUOSERVE_PACKED_LINEAR=0``: the small-row kernel and oneDNN). ``native-attention``: "before"
never announces its decode steps to the C++ ``duoserve::paged_attention``, so each layer's
attention goes through its Python kernel (then ``duoserve::decode_attention``). ``cpp-wrapper``:
"before" compiles its step with Inductor's Python wrapper (``TORCHINDUCTOR_CPP_WRAPPER=0``).
``decode-step``: "before" runs every step through the compiled graph, "after" runs steps of
decodes whole in C++ (``worker/fused_decode.py``) up to the largest batch given, whatever its
``MAX_ROWS``; with ``--quantization gguf`` (the default model's blocks, fast mode) the step
computes from the blocks. Both engines are compiled (``--compile``). Batch 1 and 32 (and
``--batches``), prompts of 128 random tokens, 100 greedy steps; median step times in ms, as JSON.
``compile``: "before" is compiled (``--compile``), "after" is the default (eager prompt steps, the
C++ decode step where the model allows it), on ``--model`` (a real file) or the default model;
the median prompt step is reported beside the decode step (``prefill``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--change", default="guard-free-step",
                        choices=["guard-free-step", "packed-linear", "native-attention", "cpp-wrapper",
                                 "decode-step", "compile"])
    parser.add_argument("--batches", default="1,32", help="comma-separated batch sizes")
    parser.add_argument("--quantization", default="none", choices=["none", "gguf"],
                        help="none: the default model's dense weights; gguf: its blocks (fast mode)")
    parser.add_argument("--model", default=None, help="a model file (--change compile; default: the default model)")
    parser.add_argument("--max-model-len", type=int, default=4096)
    args = parser.parse_args()
    from duoserve import LLM, SamplingParams
    from duoserve.core.request import Request
    from duoserve.kernels import attention

    engines, real_op = {}, attention.decode_attention_op
    variable, before_value = {"guard-free-step": ("DUOSERVE_COMPILED_GUARDS", "1"),
                              "packed-linear": ("DUOSERVE_PACKED_LINEAR", "0"),
                              "native-attention": (None, None),
                              "decode-step": (None, None),
                              "compile": (None, None),
                              "cpp-wrapper": ("TORCHINDUCTOR_CPP_WRAPPER", "0")}[args.change]
    for name, value in (("before", before_value), ("after", None)):
        if variable and value is None:
            os.environ.pop(variable, None)
        elif variable:
            os.environ[variable] = value
        model = dict(model=args.model, max_model_len=args.max_model_len) if args.model else {}
        engines[name] = LLM(dtype=args.dtype, quantization=args.quantization, kv_cache_memory=0.5, num_threads=2,
                            compile=args.change != "compile" or name == "before", **model).engine
        if args.change == "decode-step" and name == "after":
            assert engines[name].runner.forward.fused is not None, "the C++ decode step must take the model"
        if args.change == "native-attention" and name == "before":
            engines[name].runner.forward.context.native = False   # its CompiledModel's StepContext
        if args.change == "decode-step" and name == "before":
            engines[name].runner.forward.fused = None
    if args.change == "decode-step":
        from duoserve.worker import fused_decode

        fused_decode.MAX_ROWS = max(int(b) for b in args.batches.split(","))
    python_attention_before = args.change == "guard-free-step"
    rng = random.Random(0)
    result = {"dtype": args.dtype, "quantization": args.quantization}
    for batch in (int(b) for b in args.batches.split(",")):
        times: dict[str, list[float]] = {name: [] for name in engines}
        params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
        for name, engine in engines.items():
            for i in range(batch):
                prompt = [rng.randrange(1000, 40000) for _ in range(128)]
                engine.add_request(Request(f"{name}-{batch}-{i}", prompt, params, (), 4096))
        for _ in range(100):
            for name, engine in engines.items():
                python_attention = python_attention_before and name == "before"
                attention.decode_attention_op = (lambda: None) if python_attention else real_op
                if engine.has_unfinished():
                    start = time.perf_counter()
                    engine.step()
                    times[name].append(time.perf_counter() - start)
        for engine in engines.values():
            for request_id in list(engine.scheduler.requests):
                engine.release(request_id)
        skip = 4 if batch == 1 else 12 + batch // 8   # the prefill steps
        result[f"batch {batch}"] = {name: round(statistics.median(t[skip:]) * 1000, 2) for name, t in times.items()}
        if args.change == "compile":
            prompt_steps = -(-batch * 128 // 512)   # a step of up to 512 prompt tokens
            result[f"batch {batch} prefill"] = {name: round(statistics.median(t[:prompt_steps]) * 1000, 1)
                                                for name, t in times.items()}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
