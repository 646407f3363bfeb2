"""A burst of prompts arriving at once, offline: when does the last one get its first token?

    python benchmarks/prompt_burst.py --hf-dir ~/peers/smollm2-135m-hf --dtype bfloat16
    # two revisions alternated (the machine drifts): a worktree of the old one first on the path
    git worktree add /tmp/old HEAD~1
    for i in 1 2 3; do for tree in /tmp/old .; do
        PYTHONPATH=$tree python benchmarks/prompt_burst.py --hf-dir ~/peers/smollm2-135m-hf; done; done

What 32 streams of `vllm bench serve` ask first: 32 prompts of 128 random tokens (new ones each
round, so no prefix cache hit), generated with `LLM.generate` as one batch. ``--max-tokens 1``
(default) times the prompt steps alone; 128 adds the decodes the scheduler interleaves with the
later prompts' chunks. Per round: the last and the median time to first token (from the
requests' arrival), and the whole round; medians over ``--rounds``, as JSON.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hf-dir", default=None, help="the model (default: the packaged GGUF)")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    import torch

    from duoserve import LLM, SamplingParams

    torch.set_num_threads(args.threads)
    llm = LLM(args.hf_dir, dtype=args.dtype, num_threads=args.threads, quantization="none")
    rng = random.Random(time.time_ns())

    def prompts(count: int) -> list[list[int]]:
        return [[rng.randrange(1000, 40000) for _ in range(args.prompt_len)] for _ in range(count)]

    llm.generate(prompts(4), SamplingParams(max_tokens=2), use_tqdm=False)   # warm-up
    params = SamplingParams(temperature=1.0, max_tokens=args.max_tokens, ignore_eos=True)
    last, median, whole = [], [], []
    for _ in range(args.rounds):
        start = time.perf_counter()
        outs = llm.generate(prompts(args.prompts), params, use_tqdm=False)
        whole.append(time.perf_counter() - start)
        ttft = [o.metrics["first_token_time"] - o.metrics["arrival_time"] for o in outs]
        last.append(max(ttft))
        median.append(statistics.median(ttft))
    print(json.dumps({"dtype": args.dtype, "prompts": args.prompts, "max_tokens": args.max_tokens,
                      "last_ttft_s": round(statistics.median(last), 3),
                      "median_ttft_s": round(statistics.median(median), 3),
                      "round_s": round(statistics.median(whole), 3),
                      "last_ttft_each_s": [round(x, 3) for x in last]}))


if __name__ == "__main__":
    main()
