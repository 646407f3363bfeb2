"""A step of decodes run whole in C++ (``kernels/csrc/decode_step.c``), beside the compiled graph.

At a few sequences a compiled step spends a good part of its time outside its weights: the
graph's op calls through the dispatcher, their tensors allocated and freed, its small kernels
each forking the threads, all on the main thread while the others wait (BENCHMARKS.md).
``duoserve::decode_step`` runs the same decoder, one parallel region for the whole
step (the embedding rows included), over the same packed weights, caches and kernels; the
output projection after it stays as it is. It serves steps in which every sequence decodes one
token and there are at most ``MAX_ROWS`` of them; any other step runs the compiled graph, and
a model it cannot take (a weight not packed, a cache in another dtype, no C++ compiler) runs
the compiled graph for every step. ``DUOSERVE_DECODE_STEP=0`` turns it off.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from duoserve.kernels.dense import packed_linear_supported
from duoserve.kernels.linear import CPULinear, GGUFEmbedding, GGUFLinear, PackedEmbedding
from duoserve.kernels.ops import decode_step_available
from duoserve.model.attention import AttentionMetadata

# the most sequences a step may have to run here: it beat the compiled graph at every batch
# measured up to this (``benchmarks/step_ab.py --change decode-step``); larger steps are left to the graph
MAX_ROWS = 64


def _packed(linear: nn.Module, dtype: torch.dtype, bias_allowed: bool) -> bool:
    return (isinstance(linear, CPULinear) and linear.packed is not None and linear.packed.dtype == dtype
            and (linear.bias is None or (bias_allowed and linear.bias.dtype == dtype)))


def why_not(model: nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> str | None:
    """Why this model's decode steps cannot run in ``decode_step``, or None when they can."""
    if os.environ.get("DUOSERVE_DECODE_STEP", "1") == "0":
        return "DUOSERVE_DECODE_STEP=0"
    if not decode_step_available():
        return "csrc/cpu_ops.cpp is not built"
    arch = getattr(model, "arch", None)
    if arch is not None and arch.family == "moe":
        return "a mixture of experts (the C++ decode step computes dense MLPs; routed ones run in the graph)"
    if arch is None or not hasattr(model, "layers") or not hasattr(model, "rotary") or arch.family != "llama":
        return "not a Llama-family decoder"
    if arch.hidden_act != "silu":
        return f"a {arch.hidden_act} MLP (the C++ decode step computes SiLU)"
    if any(arch.window(i) is not None for i in range(arch.num_layers)):
        return "sliding-window attention (the C++ decode step attends over whole contexts)"
    dtype = model.dtype
    if model.device.type != "cpu":
        return f"the model is on {model.device.type}"
    if arch.head_dim > 512:
        return f"heads of {arch.head_dim} (at most 512)"
    if dtype not in (torch.float32, torch.bfloat16) or model.norm.weight.dtype != dtype:
        return f"activations in {dtype}"
    if any(isinstance(m, (GGUFLinear, GGUFEmbedding)) for m in model.modules()):
        return ("the model computes from GGUF blocks, and the C++ decode step reads packed dense weights only "
                "(--quantization none)")
    if not packed_linear_supported(dtype):
        return f"packed dense {str(dtype)[6:]} weights need AVX-512 on this CPU"
    embed = model.embed
    if not (isinstance(embed, PackedEmbedding) and embed.packed.dtype == dtype
            and embed.num_embeddings == arch.vocab_size):
        return "an embedding table not packed in the model's dtype"
    for layer in model.layers:
        if not (_packed(layer.qkv, dtype, True) and all(_packed(m, dtype, False)
                                                         for m in (layer.o_proj, layer.gate_up, layer.down))):
            return "a linear layer without packed weights of the model's dtype"
        norms = [layer.input_norm, layer.post_norm, *((layer.q_norm, layer.k_norm) if arch.qk_norm else ())]
        if any(norm.weight.dtype != dtype for norm in norms):
            return "a norm weight in another dtype"
    for k, v in kv_caches:
        if k.dtype != dtype or v.dtype != dtype or not (k.is_contiguous() and v.is_contiguous()):
            return f"a KV cache in {k.dtype} (the model runs {dtype})"
    return None


class FusedDecodeStep:
    """``step(input_ids, positions, meta)``: the final hidden states of a step of decodes."""

    def __init__(self, model: nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], context: int,
                 scales: list[float]) -> None:
        arch = model.arch
        tensors: list[torch.Tensor] = []
        empty = torch.empty(0, dtype=model.dtype)
        for layer, (k_cache, v_cache) in zip(model.layers, kv_caches):
            qk_norms = [layer.q_norm.weight, layer.k_norm.weight] if arch.qk_norm else [empty, empty]
            tensors += [layer.input_norm.weight, layer.post_norm.weight, *qk_norms, layer.qkv.packed,
                        empty if layer.qkv.bias is None else layer.qkv.bias, layer.o_proj.packed,
                        layer.gate_up.packed, layer.down.packed, k_cache, v_cache]
        shape = [arch.hidden_size, arch.num_heads, arch.num_kv_heads, arch.head_dim, arch.intermediate_size]
        torch.ops.duoserve.decode_model(context, tensors, model.norm.weight, model.rotary.cos, model.rotary.sin,
                                        model.embed.packed, arch.vocab_size, shape, arch.rms_norm_eps, scales)
        self.context = context

    def serves(self, meta: AttentionMetadata, num_tokens: int) -> bool:
        return not meta.prefills and meta.num_decode_tokens == num_tokens <= MAX_ROWS

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return torch.ops.duoserve.decode_step(self.context, input_ids, positions, meta.slot_mapping,
                                              meta.decode_block_tables, meta.decode_seq_lens)
