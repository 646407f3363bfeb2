"""A Q4_K_M file whose projections are K-quants, for the served comparisons of issue 60.

    python benchmarks/make_kquant_file.py --llama-quantize PATH/llama-quantize \\
        [--tokenizer-from ~/models/qwen2.5-coder-0.5b-instruct.gguf] [--dest ~/models]

The real files here (Gemma 3 270M, Qwen2.5-Coder-0.5B) are "Q4_K_M" in name only: their hidden
sizes (640, 896) are not multiples of 256, so llama-quantize falls back to Q5_0/Q8_0 for all but
their down projections. This writes a Qwen2 with Qwen2.5-1.5B's shapes (hidden 1536, 28 layers,
12 query heads and 2 KV heads of 128, MLP 8960, an untied 151,936-row output) and random weights
(normal, std 0.02; norms 1, biases 0) in F16, with the tokenizer of ``--tokenizer-from``, then
quantizes it with llama.cpp's own ``llama-quantize`` to Q4_K_M: Q4_K and Q6_K blocks, as a user's
download. Its text is noise; a server's speed on it is not (``--ignore-eos`` clients).
"""

from __future__ import annotations

import argparse
import subprocess
from pathlib import Path

import numpy as np
from gguf import GGUFReader, GGUFWriter

HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, MLP, VOCAB = 1536, 28, 12, 2, 128, 8960, 151936


def write_f16(path: Path, tokenizer_from: Path) -> None:
    src = GGUFReader(tokenizer_from)
    w = GGUFWriter(path, "qwen2")
    w.add_block_count(LAYERS)
    w.add_context_length(32768)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(MLP)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_name("random qwen2, Qwen2.5-1.5B's shapes")
    w.add_file_type(1)
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.chat_template"):
        w.add_string(key, src.fields[key].contents())
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges"):
        w.add_array(key, src.fields[key].contents())
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.padding_token_id", "tokenizer.ggml.bos_token_id"):
        w.add_uint32(key, int(src.fields[key].contents()))
    w.add_bool("tokenizer.ggml.add_bos_token", bool(src.fields["tokenizer.ggml.add_bos_token"].contents()))
    rng = np.random.default_rng(0)

    def matrix(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(np.float16)

    w.add_tensor("token_embd.weight", matrix(VOCAB, HIDDEN))
    w.add_tensor("output_norm.weight", np.ones(HIDDEN, np.float32))
    w.add_tensor("output.weight", matrix(VOCAB, HIDDEN))
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    for i in range(LAYERS):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", np.ones(HIDDEN, np.float32))
        w.add_tensor(p + "ffn_norm.weight", np.ones(HIDDEN, np.float32))
        for name, rows in (("attn_q", q), ("attn_k", kv), ("attn_v", kv)):
            w.add_tensor(p + name + ".weight", matrix(rows, HIDDEN))
            w.add_tensor(p + name + ".bias", np.zeros(rows, np.float32))
        w.add_tensor(p + "attn_output.weight", matrix(HIDDEN, q))
        w.add_tensor(p + "ffn_gate.weight", matrix(MLP, HIDDEN))
        w.add_tensor(p + "ffn_up.weight", matrix(MLP, HIDDEN))
        w.add_tensor(p + "ffn_down.weight", matrix(HIDDEN, MLP))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama-quantize", required=True)
    parser.add_argument("--tokenizer-from", default=str(Path.home() / "models" / "qwen2.5-coder-0.5b-instruct.gguf"))
    parser.add_argument("--dest", default=str(Path.home() / "models"))
    args = parser.parse_args()
    dest = Path(args.dest).expanduser()
    f16, out = dest / "random-qwen2-1.5b-f16.gguf", dest / "random-qwen2-1.5b-q4_k_m.gguf"
    write_f16(f16, Path(args.tokenizer_from).expanduser())
    try:
        subprocess.run([args.llama_quantize, str(f16), str(out), "Q4_K_M", "2"], check=True)
    finally:
        f16.unlink(missing_ok=True)
    print(out)


if __name__ == "__main__":
    main()
