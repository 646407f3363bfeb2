"""Offline throughput: duoserve vs Hugging Face transformers ``generate``, same prompts, same threads.

    python benchmarks/offline_throughput.py --dtype float32 --threads 2
    python benchmarks/offline_throughput.py --dtype bfloat16 --threads 2

Runs, in one process and one after the other: duoserve on N prompts x M new tokens
(batched), duoserve on one prompt (single stream), and HF ``generate`` batched and
left-padded on the same prompts. Prints tokens/s, the ratio, and the memory-bandwidth
roofline of one decode step (bytes read / measured copy bandwidth).
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time

import torch


def copy_bandwidth_gbs() -> float:
    """Bytes copied per second by a large tensor copy, median of 5."""
    src = torch.empty(256 << 20, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    times = []
    for _ in range(5):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return src.numel() / statistics.median(times) / 1e9


def make_prompts(num: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1000, 40000) for _ in range(length)] for _ in range(num)]


def run_duoserve(args, prompts) -> dict:
    from duoserve import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype, num_threads=args.threads, kv_cache_memory=2.0,
              quantization=args.quantization)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    batched = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == args.max_tokens for o in outs)
    start = time.perf_counter()
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    ttft = time.perf_counter() - start
    start = time.perf_counter()
    llm.generate(prompts[1:2], params, use_tqdm=False)
    single = time.perf_counter() - start
    arch = llm.engine.arch
    size = llm.engine.loaded.model.norm.weight.element_size()
    per_layer = arch.hidden_size * (arch.q_size + 2 * arch.kv_size) + arch.q_size * arch.hidden_size + \
        3 * arch.hidden_size * arch.intermediate_size
    # a decode step reads every layer's matrices and the output projection once (not the embedding table)
    weight_bytes = (arch.num_layers * per_layer + arch.vocab_size * arch.hidden_size) * size
    kv_per_token = 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * size
    avg_ctx = len(prompts[0]) + args.max_tokens / 2
    return {
        "batched_tok_s": len(prompts) * args.max_tokens / batched,
        "batched_s": batched,
        "single_tok_s": args.max_tokens / single,
        "single_tpot_ms": (single - ttft) / (args.max_tokens - 1) * 1000,
        "weight_bytes": weight_bytes,
        "kv_bytes_per_step_batched": kv_per_token * avg_ctx * len(prompts),
    }


def run_hf(args, prompts) -> dict:
    from transformers import AutoModelForCausalLM

    from duoserve.model.loader import default_model_path

    path = default_model_path() if args.model is None else args.model
    dtype = getattr(torch, args.dtype)
    if str(path).endswith(".gguf"):
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    model.eval()
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])  # left-padded
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    model.generation_config.eos_token_id = None
    with torch.inference_mode():
        model.generate(ids[:2], attention_mask=mask[:2], max_new_tokens=4, do_sample=False, pad_token_id=0)
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=args.max_tokens, do_sample=False,
                             pad_token_id=0)
        elapsed = time.perf_counter() - start
    assert out.shape[1] == width + args.max_tokens
    return {"batched_tok_s": len(prompts) * args.max_tokens / elapsed, "batched_s": elapsed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--quantization", default="none", choices=["none", "gguf", "int8", "auto"],
                        help="duoserve's weights (default: none, the dequantized weights transformers runs)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    prompts = make_prompts(args.num_prompts, args.prompt_len)
    bandwidth = copy_bandwidth_gbs()
    ours = run_duoserve(args, prompts)
    result = {"machine": f"{platform.machine()} {torch.get_num_threads()} threads", "torch": torch.__version__,
              "dtype": args.dtype, "copy_bandwidth_gbs": bandwidth, "duoserve": ours}
    # roofline: a decode step reads every weight once plus the batch's KV, at (at best) copy bandwidth
    read_bw = bandwidth * 1e9
    result["roofline_single_tpot_ms"] = ours["weight_bytes"] / read_bw * 1000
    result["roofline_batched_step_ms"] = (ours["weight_bytes"] + ours["kv_bytes_per_step_batched"]) / read_bw * 1000
    result["measured_batched_step_ms"] = ours["batched_s"] / args.max_tokens * 1000
    if not args.skip_hf:
        hf = run_hf(args, prompts)
        result["hf"] = hf
        result["ratio_batched_vs_hf"] = ours["batched_tok_s"] / hf["batched_tok_s"]
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
