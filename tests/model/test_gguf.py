"""GGUF: dequantization of every supported type, and files written with gguf's own writer."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter, quants
from safetensors.torch import load_file

from duoserve.config import ModelConfig
from duoserve.model.dequant import dequantize
from duoserve.worker.backends import load_model
from tests.helpers import forward_one
from tests.model.kquants import QUANTIZERS

PROMPT = [3, 141, 59, 26, 53, 58, 97, 93, 238, 46, 26, 43, 38, 32, 79, 50, 28, 8]

# byte offsets of the float16 scale fields in each block, kept finite in random blocks
F16_FIELDS = {"Q8_0": [0], "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208],
              "Q2_K": [80, 82], "Q3_K": [108], "IQ4_NL": [0]}


@pytest.mark.parametrize("type_name", list(F16_FIELDS))
def test_dequantize_matches_gguf_reference(type_name):
    qtype = GGMLQuantizationType[type_name]
    _, type_size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(7)
    raw = rng.integers(0, 256, size=(8, 3 * type_size), dtype=np.uint8)
    blocks = raw.reshape(-1, type_size)
    for offset in F16_FIELDS[type_name]:
        halves = rng.standard_normal(blocks.shape[0]).astype(np.float16)
        blocks[:, offset:offset + 2] = halves.view(np.uint8).reshape(-1, 2)
    ref = quants.dequantize(raw, qtype)
    ours = dequantize(raw, type_name, ref.shape)
    assert ours.dtype == torch.float32
    np.testing.assert_array_equal(ours.numpy(), ref)


@pytest.mark.parametrize("type_name", ["F32", "F16", "BF16"])
def test_dequantize_float_types(type_name):
    x = np.random.default_rng(1).standard_normal((4, 64)).astype(np.float32)
    raw = quants.quantize(x, GGMLQuantizationType[type_name])
    np.testing.assert_array_equal(dequantize(raw, type_name, (4, 64)).numpy(),
                                  quants.dequantize(raw, GGMLQuantizationType[type_name]))


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's conversion permutation of Q/K rows (what the loader must undo)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


GGUF_LAYER = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
              "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
              "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
              "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp", "block_sparse_moe.gate": "ffn_gate_inp",
              "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
              "mlp.shared_expert.down_proj": "ffn_down_shexp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp"}


# Phi-3's fused projections, as llama.cpp's converter names them (ffn_up holds gate then up)
PHI3_LAYER = {**GGUF_LAYER, "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}


GEMMA_LAYER = {**GGUF_LAYER, "post_attention_layernorm": "post_attention_norm",
               "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}


def quantize(w: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """gguf's quantizer, or the tests' own for the types it lacks (Q2_K, Q3_K)."""
    own = QUANTIZERS.get(qtype.name)
    return own(w) if own else quants.quantize(w, qtype)


def write_gguf(hf_dir: Path, out: Path, type_name: str, tokenizer=None) -> dict[str, np.ndarray]:
    """Convert a tiny HF checkpoint to GGUF as llama.cpp's converter does (Gemma: its norms stored
    plus one); returns the dequantized weights actually stored, in the checkpoint's terms.
    ``tokenizer``: a function given the writer, to add a vocabulary."""
    config = json.loads((hf_dir / "config.json").read_text())
    arch = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
            "Gemma3ForCausalLM": "gemma3", "Gemma2ForCausalLM": "gemma2", "MixtralForCausalLM": "llama",
            "Qwen2MoeForCausalLM": "qwen2moe", "Qwen3MoeForCausalLM": "qwen3moe",
            "Phi3ForCausalLM": "phi3"}[config["architectures"][0]]
    gemma = arch.startswith("gemma")
    layer_names = GEMMA_LAYER if gemma else PHI3_LAYER if arch == "phi3" else GGUF_LAYER
    writer = GGUFWriter(str(out), arch)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    rope = config["rope_parameters"]
    writer.add_rope_freq_base(rope["full_attention"]["rope_theta"] if "full_attention" in rope else rope["rope_theta"])
    writer.add_vocab_size(config["vocab_size"])
    _add_rope_scaling(writer, arch, rope)
    if arch == "phi3":
        _add_phi3(writer, config)
    if gemma:
        writer.add_sliding_window(config["sliding_window"])
    if arch == "gemma3":
        types = config["layer_types"]
        writer.add_uint32("gemma3.attention.sliding_window_pattern", types.index("full_attention") + 1)
    if arch == "gemma2":  # llama.cpp's Gemma 2 alternates local and global layers: no pattern stored
        assert config["layer_types"][:2] == ["sliding_attention", "full_attention"]
        writer.add_float32("gemma2.attn_logit_softcapping", config["attn_logit_softcapping"])
        writer.add_float32("gemma2.final_logit_softcapping", config["final_logit_softcapping"])
    experts = config.get("num_local_experts") or config.get("num_experts") or 0
    if experts:   # as llama.cpp's converter writes a mixture of experts
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config["num_experts_per_tok"])
        if "moe_intermediate_size" in config:
            writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
        if config.get("shared_expert_intermediate_size"):
            writer.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])
    if tokenizer is not None:
        tokenizer(writer)
    for key, add in (("bos_token_id", writer.add_bos_token_id), ("eos_token_id", writer.add_eos_token_id)):
        if isinstance(config.get(key), int):  # the checkpoint's special ids, as a converter writes them
            add(config[key])
    qtype = GGMLQuantizationType[type_name]
    stored = {}
    stacks: dict[str, list[tuple[int, np.ndarray]]] = {}   # blk.N.ffn_*_exps.weight -> (expert, weight)
    for name, tensor in load_file(str(hf_dir / "model.safetensors")).items():
        w = original = tensor.float().numpy()
        expert = _stacked_expert(name)
        if expert is not None:   # the experts of a layer's projection go into one stacked tensor
            stacks.setdefault(expert[0], []).append((expert[1], w))
            stored[name] = quants.dequantize(quantize(w, qtype), qtype)
            continue
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config["num_attention_heads" if "q_proj" in name else "num_key_value_heads"]
            w = _permute(w, heads)
        gguf_name = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                     "lm_head.weight": "output.weight"}.get(name)
        if gguf_name is None:
            layer, rest = name[len("model.layers."):].split(".", 1)
            stem, kind = rest.rsplit(".", 1)
            gguf_name = f"blk.{layer}.{layer_names[stem]}.{kind}"
        # norms, biases and routers stay F32, as llama.cpp's converter keeps them
        t = qtype if w.ndim == 2 and not name.endswith(("gate.weight", "expert_gate.weight")) else GGMLQuantizationType.F32
        if name.endswith("shared_expert_gate.weight"):
            w = original = w.reshape(-1)   # llama.cpp's ffn_gate_inp_shexp is a vector
            stored[name] = w.reshape(1, -1)
            writer.add_tensor(gguf_name, w, raw_dtype=t)
            continue
        if gemma and name.endswith("norm.weight"):
            w = w + 1.0
        data = quantize(w, t)
        writer.add_tensor(gguf_name, data, raw_dtype=t)
        # Quantization blocks run along rows, so permuting rows commutes with it.
        stored[name] = quants.dequantize(quantize(original, t), t)
    for gguf_name, weights in stacks.items():
        stacked = np.stack([w for _, w in sorted(weights, key=lambda item: item[0])])   # [experts, rows, cols]
        writer.add_tensor(gguf_name, quantize(stacked, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return stored


def _add_rope_scaling(writer: GGUFWriter, arch: str, rope: dict) -> None:
    """llama.cpp's keys for a YaRN rope: type, factor, original context, the ramp's ends, and the
    attention factor as llama.cpp's multiplier of YaRN's own (0.1 ln(factor) + 1)."""
    if rope.get("rope_type") != "yarn":
        return
    import math

    from gguf import RopeScalingType

    from duoserve.model.rope_params import rope_from_hf

    resolved = rope_from_hf({"rope_parameters": rope})
    writer.add_rope_scaling_type(RopeScalingType.YARN)
    writer.add_rope_scaling_factor(rope["factor"])
    writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    for key in ("beta_fast", "beta_slow"):
        if key in rope:
            writer.add_float32(f"{arch}.rope.scaling.yarn_{key}", rope[key])
    own = 0.1 * math.log(rope["factor"]) + 1.0
    if abs(resolved.attention_factor - own) > 1e-12:
        writer.add_float32(f"{arch}.rope.scaling.attn_factor", resolved.attention_factor / own)


def _add_phi3(writer: GGUFWriter, config: dict) -> None:
    """Phi-3's window, and its longrope as llama.cpp's converter writes it: the factors as F32 tensors,
    the original context and the attention factor as keys."""
    if config.get("sliding_window"):
        writer.add_sliding_window(config["sliding_window"])
    rope = config["rope_parameters"]
    if rope.get("rope_type") != "longrope":
        return
    from duoserve.model.rope_params import rope_from_hf

    resolved = rope_from_hf(config)
    writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
    writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
    writer.add_rope_scaling_orig_ctx_len(resolved.original_max_position_embeddings)
    writer.add_float32("phi3.rope.scaling.attn_factor", resolved.attention_factor)


def _stacked_expert(name: str) -> tuple[str, int] | None:
    """(the stacked GGUF tensor, the expert's index) of one expert's projection in HF's names."""
    parts = name.split(".")
    if "experts" not in parts:
        return None
    layer, expert, projection = parts[2], int(parts[parts.index("experts") + 1]), parts[-2]
    stem = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}
    return f"blk.{layer}.ffn_{stem[projection]}_exps.weight", expert


# max |logit difference| / max |logit| allowed against the unquantized original
TYPE_ERROR = {"F32": 1e-6, "F16": 2e-3, "BF16": 5e-2, "Q8_0": 5e-2, "Q5_1": 0.3, "Q4_0": 0.6}


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "gemma3", "gemma2", "mixtral", "qwen2_moe", "qwen3_moe"])
@pytest.mark.parametrize("type_name", list(TYPE_ERROR))
def test_gguf_file_gives_original_logits(tiny_dir, tmp_path, kind, type_name):
    # a Gemma 3 GGUF file's attention scale is its head size's (llama.cpp stores no query_pre_attn_scalar)
    hf_dir = tiny_dir(kind=kind, query_pre_attn_scalar=16) if kind.startswith("gemma") else tiny_dir(kind=kind)
    out = tmp_path / f"tiny-{type_name}.gguf"
    stored = write_gguf(hf_dir, out, type_name)
    original = forward_one(load_model(ModelConfig(model=str(hf_dir), dtype="float32")).model, PROMPT)
    loaded = load_model(ModelConfig(model=str(out), dtype="float32", quantization="none"))
    assert loaded.tokenizer is None
    got = forward_one(loaded.model, PROMPT)
    rel = ((got - original).abs().max() / original.abs().max()).item()
    # a mixture of experts doubles it: a quantized router can flip a token's nearly tied pick
    assert rel < TYPE_ERROR[type_name] * (2 if "moe" in kind or kind == "mixtral" else 1)
    # Exactness of the loader itself: the same logits as the original model carrying the
    # stored (quantized, then dequantized) weights, Q/K permutation undone.
    ref_model = load_model(ModelConfig(model=str(hf_dir), dtype="float32")).model
    source = {k: torch.from_numpy(np.array(v)) for k, v in stored.items()}
    from duoserve.model.weights import checkpoint_parts

    state = {name: torch.cat([source[src] for src, _ in parts]) for name, parts in
             checkpoint_parts(ref_model.arch).items()}
    ref_model.load_state_dict(state, strict=False)
    assert (got - forward_one(ref_model, PROMPT)).abs().max().item() < 1e-4


def test_experts_that_do_not_match_the_stated_count_name_the_tensor(tiny_dir, tmp_path):
    """A stacked expert tensor holds one matrix per expert: a file stating another count is a load
    error naming the tensor and both shapes, never a model built from misaligned slices."""
    from duoserve.errors import ModelLoadError

    out = tmp_path / "moe.gguf"
    write_gguf(tiny_dir(kind="qwen3_moe"), out, "Q8_0")
    with pytest.raises(ModelLoadError, match=r"GGUF tensor blk\.0\.ffn_gate_exps\.weight has shape \[4, 32, 64\], "
                                             r"expected \[3, rows, cols\] \(one matrix per expert\)"):
        load_model(ModelConfig(model=str(out), dtype="float32", quantization="none",
                               hf_overrides={"num_experts": 3, "num_local_experts": 3}))
