"""The model's opaque ops for ``torch.compile``: ``duoserve::linear`` (and ``duoserve::packed_linear``
over a weight packed at load), ``duoserve::paged_attention``,
and for GGUF blocks ``duoserve::gguf_linear`` and ``duoserve::gguf_embedding``.

Inside a compiled graph, a linear layer and a layer's attention are each one call that the
compiler does not trace into: their kernels (the small-row C kernel or oneDNN's GEMM, the C
decode attention or the prefill path, the packed-block kernels) are chosen at run time by
the batch's shape, never guarded on, and the graph never breaks on ctypes. Defined once,
on first use.

The attention op's KV caches and the step's ``AttentionMetadata`` are not graph inputs
(their shapes vary every step and would recompile the graph): they sit in a
``StepContext``, reached by an integer handle baked into the graph. Where csrc/cpu_ops.cpp
builds, ``paged_attention`` is C++: each step is announced to it (``attention_step``, with
every layer's caches and the step's slots, and every token's block table and context length)
and each layer runs the C kernel over all the step's tokens with no Python; without the
announcement (no C++ build) the Python kernel ``paged_attention_any`` runs. The registry of
contexts is the one module-level mutable object here, append-only, because an op argument
can only be a tensor or a plain value.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
from torch import nn

from duoserve.model.attention import C_CACHE_DTYPES, AttentionMetadata, PagedAttention, paged_attention


@dataclass
class StepContext:
    """What the attention op reads during one forward."""
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    layers: list[PagedAttention]                 # the eager modules: scale and head slots
    meta: AttentionMetadata | None = None        # set for the duration of one forward
    handle: int = -1                             # its index in the registry
    announced: bool = False                      # this forward announced to the C++ op

    def __post_init__(self) -> None:
        # what every announcement passes, fixed for the model's life: gathered once, not each step
        k_cache = self.kv_caches[0][0]
        self.native = k_cache.device.type == "cpu" and k_cache.dtype in C_CACHE_DTYPES and native_attention()
        self._k_caches = [k for k, _ in self.kv_caches]
        self._v_caches = [v for _, v in self.kv_caches]
        self.scales = [layer.scale for layer in self.layers]

    def begin(self, meta: AttentionMetadata) -> None:
        """Before a forward: its metadata; where the C++ ``paged_attention`` serves the model, the
        step is also announced to it, every token a row over its own causal context (a decode,
        or a prompt token as the Python kernel runs it: ``_prefill_by_decode_kernel``), and each
        layer then runs with no Python (``end`` clears it)."""
        self.meta = meta
        if self.native:
            tables, lens = meta.token_contexts()
            torch.ops.duoserve.attention_step(self.handle, self._k_caches, self._v_caches, meta.slot_mapping,
                                              tables, lens, self.scales)
            self.announced = True

    def end(self) -> None:
        self.meta = None
        if self.announced:
            torch.ops.duoserve.attention_step(self.handle, [], [], None, None, None, [])
            self.announced = False


_CONTEXTS: list[StepContext] = []


def register_context(context: StepContext) -> int:
    define_ops()
    _CONTEXTS.append(context)
    context.handle = len(_CONTEXTS) - 1
    return context.handle


@lru_cache(maxsize=1)
def native_attention() -> bool:
    """Whether ``duoserve::paged_attention`` runs its C++ kernel (csrc/cpu_ops.cpp built)."""
    define_ops()
    return torch._C._dispatch_has_kernel("duoserve::attention_step")


@lru_cache(maxsize=1)
def define_ops() -> torch.library.Library:
    from duoserve.model.cpu_linear import linear_any_m
    from duoserve.model.quantized import gguf_embedding, packed_linear

    lib = torch.library.Library("duoserve", "DEF")
    lib.define("linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor")
    lib.define("paged_attention(Tensor q, Tensor k, Tensor v, int context, int layer) -> Tensor")
    # its Python kernel, which the C++ one calls for any step but one of decodes
    lib.define("paged_attention_any(Tensor q, Tensor k, Tensor v, int context, int layer) -> Tensor")
    # a compiled step announced to the C++ paged_attention (csrc/cpu_ops.cpp), and
    # cleared after it (slot_mapping None): its layers' caches and scales and the step's metadata
    lib.define("attention_step(int context, Tensor[] k_caches, Tensor[] v_caches, Tensor? slot_mapping, "
               "Tensor? block_tables, Tensor? seq_lens, float[] scales) -> ()")
    # a decode step's attention of one layer, KV written in place: C++ only (csrc/cpu_ops.cpp);
    # without it paged_attention makes the same calls from Python
    lib.define("decode_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, "
               "Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, float scale) -> Tensor")

    # a model whose decode steps run whole in C++ (csrc/decode_step.c; worker/fused_decode.py):
    # per layer its input norm, post norm, q and k norms (or empty tensors), packed qkv, qkv bias
    # (or an empty tensor), packed o, gate_up and down, K and V caches; its embedding table packed
    # (PackedEmbedding); shape: hidden, heads, KV heads, head dim, intermediate
    lib.define("decode_model(int context, Tensor[] layers, Tensor final_norm, Tensor cos, Tensor sin, "
               "Tensor embedding, int vocab, int[] shape, float eps, float[] scales) -> ()")
    # one decode step of that model: input_ids [rows] -> the final norm's output [rows, hidden]
    lib.define("decode_step(int context, Tensor input_ids, Tensor positions, Tensor slot_mapping, "
               "Tensor block_tables, Tensor seq_lens) -> Tensor")

    def attention(q, k, v, context, layer):
        ctx = _CONTEXTS[context]
        module = ctx.layers[layer]
        k_cache, v_cache = ctx.kv_caches[layer]
        return paged_attention(q, k, v, k_cache, v_cache, ctx.meta, module.scale, module.head_slot)


    lib.impl("linear", lambda x, weight, bias: x.new_empty((*x.shape[:-1], weight.shape[0])), "Meta")
    # over a weight packed at load (cpu_kernels.pack_linear_weight); n: the output features
    lib.define("packed_linear(Tensor x, Tensor packed, Tensor? bias, int n) -> Tensor")
    lib.impl("packed_linear", lambda x, packed, bias, n: x.new_empty((*x.shape[:-1], n), dtype=packed.dtype), "Meta")
    lib.define("gguf_linear(Tensor x, Tensor blocks, int type_id, int cols, str mode) -> Tensor")
    lib.define("gguf_embedding(Tensor ids, Tensor blocks, int type_id, int cols, ScalarType dtype) -> Tensor")
    from duoserve.model.cpu_kernels import c_packed_linear, load_torch_op_library

    native = load_torch_op_library()  # csrc/cpu_ops.cpp: the C++ kernels of the linears and attention
    if not native:
        lib.impl("linear", linear_any_m, "CPU")
        lib.impl("packed_linear", c_packed_linear, "CPU")
        lib.impl("gguf_linear", packed_linear, "CPU")
    lib.impl("gguf_linear", lambda x, blocks, type_id, cols, mode: x.new_empty((*x.shape[:-1], blocks.shape[0])),
             "Meta")
    lib.impl("gguf_embedding", gguf_embedding, "CPU")
    lib.impl("gguf_embedding", lambda ids, blocks, type_id, cols, dtype: ids.new_empty((*ids.shape, cols), dtype=dtype),
             "Meta")
    lib.impl("paged_attention_any", attention, "CPU")
    if not native:
        lib.impl("paged_attention", attention, "CPU")
    lib.impl("paged_attention", lambda q, k, v, context, layer: q.new_empty((q.shape[0], q.shape[1] * q.shape[2])),
             "Meta")
    return lib


class OpAttention(nn.Module):
    """A layer's attention as one opaque op while compiling (its cache and metadata come from the
    context); run eagerly, the module it wraps."""

    def __init__(self, eager: PagedAttention, context: int, layer: int) -> None:
        super().__init__()
        self.eager, self.context, self.layer = eager, context, layer

    def forward(self, q, k, v, kv_cache, meta) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return torch.ops.duoserve.paged_attention(q, k, v, self.context, self.layer)
        return self.eager(q, k, v, kv_cache, meta)
