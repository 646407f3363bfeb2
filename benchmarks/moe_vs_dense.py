"""A mixture of experts against a dense model of the same active size: decode steps and memory.

    python benchmarks/moe_vs_dense.py --out benchmarks/results/DATE-moe-vs-dense.json

Two random checkpoints built with transformers (seeded; no real MoE file of this size is on this
machine): a Qwen3-MoE with 8 experts of 768, 2 a token, and a Llama whose MLP is 1536 wide, so a
token reads the same MLP weights in both; the same attention, 12 layers of 576, SmolLM2's
vocabulary size. Each is run through ``benchmarks/step_times.py`` (its own process, float32,
compiled with --compile) and its checkpoint's size is reported beside it.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

SHAPE = dict(hidden_size=576, num_hidden_layers=12, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
             vocab_size=49152, max_position_embeddings=4096, tie_word_embeddings=True)


def build(path: Path, kind: str) -> None:
    import torch
    import transformers

    if (path / "config.json").exists():
        return
    if kind == "moe":
        config = transformers.Qwen3MoeConfig(**SHAPE, intermediate_size=1536, moe_intermediate_size=768,
                                             num_experts=8, num_experts_per_tok=2, norm_topk_prob=True)
        model_cls = transformers.Qwen3MoeForCausalLM
    else:
        config = transformers.LlamaConfig(**SHAPE, intermediate_size=1536)
        model_cls = transformers.LlamaForCausalLM
    torch.manual_seed(0)
    model_cls(config).save_pretrained(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default=str(Path.home() / "models" / "moe-vs-dense"))
    parser.add_argument("--out", default=None)
    parser.add_argument("--compile", action="store_true")
    args = parser.parse_args()
    result = {"date": time.strftime("%Y-%m-%d"), "machine": platform.processor() or platform.machine(),
              "command": " ".join(sys.argv), "shape": SHAPE}
    for kind in ("dense", "moe"):
        path = Path(args.dir) / kind
        build(path, kind)
        command = [sys.executable, str(Path(__file__).with_name("step_times.py")), "--model", str(path),
                   "--dtype", "float32", "--max-model-len", "1024"] + (["--compile"] if args.compile else [])
        out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
        steps = json.loads(out[out.index("{"):])
        size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
        result[kind] = {"checkpoint_mb": round(size / 2**20), **{k: v for k, v in steps.items() if k.startswith("batch")}}
        print(kind, json.dumps(result[kind]), flush=True)
    for key in result["dense"]:
        if key.startswith("batch"):
            result.setdefault("moe_over_dense_step", {})[key] = round(
                result["moe"][key]["median_step_ms"] / result["dense"][key]["median_step_ms"], 2)
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
