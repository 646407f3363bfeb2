"""Write the packaged SmolLM2 GGUF out as a Hugging Face directory (fp32 safetensors + tokenizer).

    python benchmarks/export_hf.py /tmp/smollm2-135m-hf

Peers that cannot read this GGUF (vLLM's CPU backend, the `vllm bench serve` client's
tokenizer) load the directory instead; the weights are the same dequantized values.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from safetensors.torch import save_file


def main() -> None:
    from transformers import AutoTokenizer, LlamaConfig

    from duoserve.config import ModelConfig
    from duoserve.model.loader import default_model_path
    from duoserve.worker.backends import load_model
    from duoserve.model.weights import checkpoint_parts

    out = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/smollm2-135m-hf")
    out.mkdir(parents=True, exist_ok=True)
    loaded = load_model(ModelConfig(dtype="float32", quantization="none"))  # dequantized, dense
    arch = loaded.arch
    state = dict(loaded.model.state_dict())
    tensors = {}
    for name, pieces in checkpoint_parts(arch).items():  # un-fuse q/k/v and gate/up
        parts = state[name].split([shape[0] for _, shape in pieces], dim=0)
        for (hf_name, _), part in zip(pieces, parts):
            tensors[hf_name] = part.contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = LlamaConfig(
        vocab_size=arch.vocab_size, hidden_size=arch.hidden_size, intermediate_size=arch.intermediate_size,
        num_hidden_layers=arch.num_layers, num_attention_heads=arch.num_heads,
        num_key_value_heads=arch.num_kv_heads, head_dim=arch.head_dim, rms_norm_eps=arch.rms_norm_eps,
        max_position_embeddings=arch.max_position_embeddings, tie_word_embeddings=arch.tie_word_embeddings,
        rope_theta=arch.rope.theta, bos_token_id=1, eos_token_id=2, torch_dtype="float32")
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(out)
    gguf = default_model_path()
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(out)
    cfg = json.loads((out / "config.json").read_text())
    print(out, cfg["num_hidden_layers"], "layers")


if __name__ == "__main__":
    main()
