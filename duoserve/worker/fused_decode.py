"""A step of decodes run whole in C++ (``kernels/csrc/decode_step.c``), beside the compiled graph.

It takes the Llama family (Llama, Mistral, Qwen2, Qwen3, Phi-3, their sliding windows too),
Gemma 2 and 3 (their four norms a layer, tanh-GELU, local layers with their windows and rope,
Gemma 2's capped scores; the logits' cap stays with the output projection, after it) and the
mixtures of experts (Mixtral, Qwen2-MoE with its shared expert, Qwen3-MoE: each row's experts
chosen by glue.c's routing, each chosen expert run once over its rows, the others never read).

At a few sequences a compiled step spends a good part of its time outside its weights: the
graph's op calls through the dispatcher, their tensors allocated and freed, its small kernels
each forking the threads, all on the main thread while the others wait (BENCHMARKS.md).
``duoserve::decode_step`` runs the same decoder, one parallel region for the whole
step (the embedding rows included), over the same packed weights or GGUF blocks (GGUFLinear's
runs, GGUFEmbedding's rows, the same arithmetic), caches and kernels; the
output projection after it stays as it is. It serves every step of at most ``MAX_ROWS`` tokens,
each token a row over its own causal context: decodes, a speculating sequence's guesses (a
verification step used to leave it for the slower graph), short prompt chunks, which the C attention
computes row by row too, so the bits match the other paths'. Larger steps run the compiled graph
(or the eager model), and a model it cannot take (a weight neither packed nor in blocks, a cache in another dtype, no C++ compiler) runs
the compiled graph for every step. ``DUOSERVE_DECODE_STEP=0`` turns it off.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from duoserve import envs
from duoserve.kernels.dense import packed_linear_supported
from duoserve.kernels.linear import CPULinear, GGUFEmbedding, GGUFLinear, PackedEmbedding
from duoserve.kernels.ops import StepContext, decode_step_available, register_context
from duoserve.model.attention import AttentionMetadata

logger = logging.getLogger(__name__)

# the most sequences a step may have to run here: it beat the compiled graph at every batch
# measured up to this (``benchmarks/step_ab.py --change decode-step``); larger steps are left to the graph
MAX_ROWS = 64
MAX_RUNS = 4   # block runs of one projection (decode_step.c)
FAMILIES = {"llama": "silu", "gemma": "gelu_tanh", "moe": "silu"}   # the decoders it computes, their MLPs' activation
MAX_EXPERTS = 512   # a router's outputs (csrc/glue.h's GLUE_MAX_EXPERTS)


def layer_norms(layer: nn.Module, family: str) -> tuple:
    """A layer's norms as decode_step.c takes them: before attention, before the MLP, and Gemma's
    after attention and after the MLP (None elsewhere)."""
    if family == "gemma":
        return layer.input_norm, layer.pre_ffn_norm, layer.post_attn_norm, layer.post_ffn_norm
    return layer.input_norm, layer.post_norm, None, None

def routed(layer: nn.Module) -> nn.Module | None:
    """A layer's routed MLP (model/moe.py's SparseMoE; inside a compiled model's EagerModule), or None."""
    moe = getattr(layer, "moe", None)
    return getattr(moe, "inner", moe)


def mlp_linears(layer: nn.Module) -> list[nn.Module]:
    """A layer's MLP projections: gate_up and down, or a routed MLP's router, every expert's
    gate_up and down, and the shared expert's gate_up, down and gate."""
    moe = routed(layer)
    if moe is None:
        return [layer.gate_up, layer.down]
    shared = [] if moe.shared is None else [moe.shared.gate_up, moe.shared.down, moe.shared_gate]
    return [moe.router, *(e.gate_up for e in moe.experts), *(e.down for e in moe.experts), *shared]


def _packed(linear: nn.Module, dtype: torch.dtype, bias_allowed: bool) -> bool:
    return (isinstance(linear, CPULinear) and linear.packed is not None and linear.packed.dtype == dtype
            and (linear.bias is None or (bias_allowed and linear.bias.dtype == dtype)))


def _blocks(linear: nn.Module, mode: str) -> bool:
    return isinstance(linear, GGUFLinear) and linear.mode == mode and len(linear.runs) <= MAX_RUNS


def _linears_why_not(model: nn.Module, dtype: torch.dtype) -> str | None:
    """Why the layers' projections cannot be read here: each packed in the model dtype, or GGUF
    blocks (one mode for the whole model)."""
    modes = {m.mode for m in model.modules() if isinstance(m, GGUFLinear)}
    if len(modes) > 1:
        return "GGUF projections in both modes"
    mode = modes.pop() if modes else None
    packed = False
    for layer in model.layers:
        for linear in (layer.qkv, layer.o_proj, *mlp_linears(layer)):
            if _packed(linear, dtype, linear is layer.qkv):
                packed = True
            elif not (mode and _blocks(linear, mode)):
                return "a linear layer neither packed in the model's dtype nor in GGUF blocks (at most 4 block types)"
    if packed and not packed_linear_supported(dtype):
        return f"packed dense {str(dtype)[6:]} weights need AVX-512 on this CPU"
    return None


def _embedding_why_not(model: nn.Module, dtype: torch.dtype) -> str | None:
    embed, arch = model.embed, model.arch
    if isinstance(embed, GGUFEmbedding):
        if embed.dtype != dtype or embed.cols != arch.hidden_size or embed.blocks.shape[0] < arch.vocab_size:
            return "GGUF embedding rows in another dtype or shape"
        return None
    if not (isinstance(embed, PackedEmbedding) and embed.packed.dtype == dtype
            and embed.num_embeddings == arch.vocab_size):
        return "an embedding table neither packed in the model's dtype nor in GGUF blocks"
    return None


def why_not(model: nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> str | None:
    """Why this model's decode steps do not run in ``decode_step``, or None when they do."""
    if not envs.DUOSERVE_DECODE_STEP:
        return "DUOSERVE_DECODE_STEP=0"
    return why_not_takes(model, kv_caches)


def why_not_takes(model: nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> str | None:
    """Why ``FusedDecodeStep`` cannot compute this model's decode steps, or None when it can."""
    if not decode_step_available():
        return "csrc/cpu_ops.cpp is not built"
    arch = getattr(model, "arch", None)
    if arch is not None and arch.family == "moe" and arch.num_experts > MAX_EXPERTS:
        return f"{arch.num_experts} experts (at most {MAX_EXPERTS})"
    if arch is None or not hasattr(model, "layers") or not hasattr(model, "rotary") or arch.family not in FAMILIES:
        return "not a Llama-family or Gemma decoder"
    if arch.hidden_act != FAMILIES[arch.family]:
        computes = FAMILIES[arch.family]
        return f"a {arch.hidden_act} MLP in a {arch.family} model (the C++ decode step computes {computes})"
    dtype = model.dtype
    if model.device.type != "cpu":
        return f"the model is on {model.device.type}"
    if arch.head_dim > 512:
        return f"heads of {arch.head_dim} (at most 512)"
    if dtype not in (torch.float32, torch.bfloat16) or model.norm.weight.dtype != dtype:
        return f"activations in {dtype}"
    reason = _linears_why_not(model, dtype) or _embedding_why_not(model, dtype)
    if reason:
        return reason
    for layer in model.layers:
        bias = layer.qkv.bias
        if isinstance(layer.qkv, GGUFLinear) and bias is not None and not bias.dtype.is_floating_point:
            return f"a q/k/v bias in {bias.dtype}"
        norms = [*layer_norms(layer, arch.family), *((layer.q_norm, layer.k_norm) if arch.qk_norm else ())]
        if any(norm.weight.dtype != dtype for norm in norms if norm is not None):
            return "a norm weight in another dtype"
    for k, v in kv_caches:
        if k.dtype != dtype or v.dtype != dtype or not (k.is_contiguous() and v.is_contiguous()):
            return f"a KV cache in {k.dtype} (the model runs {dtype})"
    return None


class _Projections:
    """Projections as decode_model takes them: ``take(linear)`` is its packed weight, or an empty
    tensor with its runs' blocks and type ids appended to ``blocks`` and ``block_types``; ``runs``
    gets each one's number of runs (0: packed)."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.empty = torch.empty(0, dtype=dtype)
        self.blocks: list[torch.Tensor] = []
        self.block_types: list[int] = []
        self.runs: list[int] = []

    def __call__(self, linear: nn.Module) -> torch.Tensor:
        if not isinstance(linear, GGUFLinear):
            self.runs.append(0)
            return linear.packed
        self.runs.append(len(linear.runs))
        for name, type_id, _ in linear.runs:
            self.blocks.append(getattr(linear, name))
            self.block_types.append(type_id)
        return self.empty


NO_LORA = torch.empty(0, dtype=torch.long)   # a step without LoRA rows


class FusedDecodeStep:
    """``step(input_ids, positions, meta)``: the final hidden states of a step of decodes."""

    def __init__(self, model: nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 context: StepContext) -> None:
        """The model handed to C++ under ``context``'s (registered) handle, each layer's attention
        with the context's scale, window and cap: the ones its attention op uses."""
        arch, dtype = model.arch, model.dtype
        tensors: list[torch.Tensor] = []
        take = _Projections(dtype)
        empty = take.empty
        gemma = arch.family == "gemma"
        for layer, (k_cache, v_cache) in zip(model.layers, kv_caches):
            norms = [empty if norm is None else norm.weight for norm in layer_norms(layer, arch.family)]
            qk_norms = [layer.q_norm.weight, layer.k_norm.weight] if arch.qk_norm else [empty, empty]
            # GGUFLinear adds bias.to(y.dtype): the rounding made once here
            bias = empty if layer.qkv.bias is None else layer.qkv.bias.to(dtype).contiguous()
            qkv, o_proj = take(layer.qkv), take(layer.o_proj)   # in this order: the runs are listed so
            if routed(layer) is None:
                mlp = [take(layer.gate_up), take(layer.down)]
            else:   # given to decode_model_moe below
                mlp = [empty, empty]
                take.runs += [-1, -1]
            tensors += [*norms, *qk_norms, qkv, bias, o_proj, *mlp, k_cache, v_cache]
        shape = [arch.hidden_size, arch.num_heads, arch.num_kv_heads, arch.head_dim, arch.intermediate_size]
        local = getattr(model, "local_rotary", model.rotary)   # Gemma 3's local layers' own rope
        local_layers = [int(gemma and bool(w)) for w in context.windows]
        # Gemma scales its embedding by sqrt(hidden) rounded to the model dtype first, as gemma.py
        embed_scale = torch.tensor(arch.hidden_size ** 0.5, dtype=dtype).item() if gemma else 1.0
        embed = model.embed
        gguf_embed = isinstance(embed, GGUFEmbedding)
        exact = int("exact" in {m.mode for m in model.modules() if isinstance(m, GGUFLinear)})
        torch.ops.duoserve.decode_model(context.handle, tensors, model.norm.weight, model.rotary.cos,
                                        model.rotary.sin, local.cos, local.sin,
                                        embed.blocks if gguf_embed else embed.packed, arch.vocab_size, shape,
                                        arch.rms_norm_eps, context.scales, context.windows, context.caps,
                                        local_layers, take.blocks, take.block_types, take.runs, exact,
                                        embed.type_id if gguf_embed else -1, int(gemma), embed_scale)
        for index, layer in enumerate(model.layers):
            moe = routed(layer)
            if moe is not None:
                take = _Projections(dtype)
                weights = [take(linear) for linear in mlp_linears(layer)]
                torch.ops.duoserve.decode_model_moe(
                    context.handle, index, weights, take.blocks, take.block_types, take.runs, moe.top_k,
                    int(moe.renormalize), arch.moe_intermediate_size, arch.shared_expert_intermediate_size or 0,
                    moe.expert_tokens, exact)
        self.context = context.handle
        self.tiled_prefill = envs.DUOSERVE_TILED_PREFILL   # as kernels/build.py sets csrc/paged_prefill.c

    def serves(self, meta: AttentionMetadata, num_tokens: int) -> bool:
        """Any step of at most ``MAX_ROWS`` tokens: decodes, a speculating sequence's guesses, short
        prompt chunks, each token a row over its own causal context, as the C attention computes a
        prompt's tokens; unless that attention tiles prompt runs (``DUOSERVE_TILED_PREFILL=1``, a
        kernel this step does not run): then steps of decodes alone."""
        return num_tokens <= MAX_ROWS and (not meta.prefills or not self.tiled_prefill)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        tables, lens = meta.token_contexts()
        row_adapter, lora_tables = meta.lora if meta.lora is not None else (NO_LORA, NO_LORA)
        return torch.ops.duoserve.decode_step(self.context, input_ids, positions, meta.slot_mapping, tables, lens,
                                              row_adapter, lora_tables)


def fused_step(model: nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], context: StepContext,
               otherwise: str) -> FusedDecodeStep | None:
    """The model's C++ decode step under ``context``'s (registered) handle, or None, saying once why
    its steps of decodes run ``otherwise``."""
    reason = why_not(model, kv_caches)
    if reason:
        logger.info("decode steps run %s, not the C++ decode step: %s", otherwise, reason)
        return None
    return FusedDecodeStep(model, kv_caches, context)


class EagerDecodeStep:
    """``model(input_ids, positions, kv_caches, meta)`` without a compile: steps of decodes in
    ``FusedDecodeStep`` where the model allows it, every other step (prompts, mixed, larger) in the
    eager model, whose per-op overhead is small beside a prompt's work. Both compute a row to the
    same bits (the same kernels and glue), so which path a token took never shows in the answer."""

    def __init__(self, model: nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.model = model
        context = StepContext(kv_caches, [layer.attn for layer in model.layers])
        register_context(context, owner=self)
        self.fused = fused_step(model, kv_caches, context, "the eager model")

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches, meta: AttentionMetadata):
        if self.fused is not None and self.fused.serves(meta, input_ids.shape[0]):
            return self.fused(input_ids, positions, meta)
        return self.model(input_ids, positions, kv_caches, meta)
