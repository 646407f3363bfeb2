"""Every custom op of duoserve (``torch.ops.duoserve.*``), defined here once, on first use.

Linears: ``duoserve::linear`` (a plain weight), ``duoserve::packed_linear`` (a dense weight
repacked at load), ``duoserve::gguf_linear`` and ``duoserve::gguf_embedding`` (GGUF blocks).
A layer's small ops: ``duoserve::rms_norm``, ``duoserve::rotary``, ``duoserve::silu_mul``
(``duoserve.kernels.glue``). Attention: ``duoserve::paged_attention`` (a layer of a compiled model), ``duoserve::decode_attention``
(a decode step's layer, C++ only) and ``duoserve::attention_step``. The C++ decode step:
``duoserve::decode_model`` and ``duoserve::decode_step`` (``duoserve.worker.fused_decode``). A module
whose work depends on its input's values (a mixture of experts' routing): ``duoserve::eager_module``.

Inside a compiled graph, a linear layer and a layer's attention are each one call that the
compiler does not trace into: their kernels (the small-row C kernel or oneDNN's GEMM, the C
decode attention or the prefill path, the block kernels) are chosen at run time by the batch's
shape, never guarded on, and the graph never breaks on ctypes. Where ``csrc/cpu_ops.cpp`` builds,
its C++ kernels are registered; otherwise the Python kernels below.

The attention op's KV caches and the step's metadata are not graph inputs (their shapes vary
every step and would recompile the graph): they sit in a ``StepContext``, reached by an integer
handle baked into the graph. Where the C++ ``paged_attention`` serves the model, each step is
announced to it (``attention_step``: every layer's caches and the step's slots, and every
token's block table and context length) and each layer runs the C kernel over all the step's
tokens with no Python; without the announcement the Python kernel ``paged_attention_any`` runs
the layer's eager attention module. The registries of contexts and of eager modules are the
module-level mutable objects here, append-only, because an op argument can only be a tensor or a
plain value.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Protocol
import weakref

import torch
from torch import nn

from duoserve.kernels.build import load_torch_op_library
from duoserve.kernels.dense import c_packed_linear, linear_any_m
from duoserve.kernels.gguf import gguf_embedding, gguf_linear

C_CACHE_DTYPES = (torch.float32, torch.bfloat16)   # the KV cache dtypes the C attention kernels read


class StepMetadata(Protocol):
    """What the kernels read of a step's attention metadata (the model's ``AttentionMetadata``)."""
    slot_mapping: torch.Tensor           # [num_tokens] long
    num_decode_tokens: int
    decode_block_tables: torch.Tensor | None   # [num_decodes, max_blocks] long
    decode_seq_lens: torch.Tensor | None       # [num_decodes] long
    prefills: list

    def token_contexts(self) -> tuple[torch.Tensor, torch.Tensor]: ...

    def longest_context(self) -> int: ...


@dataclass
class StepContext:
    """What the attention op reads during one forward."""
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    layers: list[nn.Module]                  # each layer's eager attention module (it has a ``scale``)
    meta: StepMetadata | None = None         # set for the duration of one forward
    handle: int = -1                         # its index in the registry
    announced: bool = False                  # this forward announced to the C++ op

    def __post_init__(self) -> None:
        # what every announcement passes, fixed for the model's life: gathered once, not each step
        k_cache = self.kv_caches[0][0]
        self.native = k_cache.device.type == "cpu" and k_cache.dtype in C_CACHE_DTYPES and native_attention()
        self._k_caches = [k for k, _ in self.kv_caches]
        self._v_caches = [v for _, v in self.kv_caches]
        self.scales = [layer.scale for layer in self.layers]
        # each layer's sliding window and score cap (0: none), as the C kernels take them
        self.windows = [getattr(layer, "window", None) or 0 for layer in self.layers]
        self.caps = [getattr(layer, "cap", None) or 0.0 for layer in self.layers]

    def begin(self, meta: StepMetadata) -> None:
        """Before a forward: its metadata; where the C++ ``paged_attention`` serves the model, the
        step is also announced to it, every token a row over its own causal context (a decode, or
        a prompt token as the C attention backend runs it), and each layer then runs with no
        Python (``end`` clears it)."""
        self.meta = meta
        if self.native:
            tables, lens = meta.token_contexts()
            torch.ops.duoserve.attention_step(self.handle, self._k_caches, self._v_caches, meta.slot_mapping,
                                              tables, lens, self.scales, self.windows, self.caps)
            self.announced = True

    def end(self) -> None:
        self.meta = None
        if self.announced:
            torch.ops.duoserve.attention_step(self.handle, [], [], None, None, None, [], [], [])
            self.announced = False


_CONTEXTS: list[StepContext | None] = []


def register_context(context: StepContext, owner: object | None = None) -> int:
    """The context's handle; with an ``owner``, released when the owner goes (``release_context``),
    else its caches and weights would outlive the engine."""
    define_ops()
    _CONTEXTS.append(context)
    context.handle = len(_CONTEXTS) - 1
    if owner is not None:
        weakref.finalize(owner, release_context, context.handle)
    return context.handle


def release_context(handle: int) -> None:
    """Forget a context and the C++ decode model registered under its handle, if any (their
    owner is gone): the caches and weights they hold can be freed. Every engine of a process
    (a test session builds hundreds) registers one."""
    _CONTEXTS[handle] = None
    if decode_step_available():
        torch.ops.duoserve.decode_model_release(handle)


def layer_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context: int, layer: int) -> torch.Tensor:
    """The Python kernel of ``paged_attention``: the layer's eager attention over its context's caches."""
    ctx = _CONTEXTS[context]
    return ctx.layers[layer].forward(q, k, v, ctx.kv_caches[layer], ctx.meta)


_EAGER_MODULES: list[nn.Module] = []


class EagerModule(nn.Module):
    """``module`` called from a compiled graph as one op (``duoserve::eager_module``) that runs it
    eagerly: what it computes may depend on its input's values (which experts a mixture of experts
    runs, over how many tokens), which a whole graph cannot trace. Its output has its input's shape."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        define_ops()
        self.inner = module
        _EAGER_MODULES.append(module)
        self.handle = len(_EAGER_MODULES) - 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.duoserve.eager_module(x, self.handle)


def _run_eager_module(x: torch.Tensor, handle: int) -> torch.Tensor:
    return _EAGER_MODULES[handle](x)


@lru_cache(maxsize=1)
def native_attention() -> bool:
    """Whether ``duoserve::paged_attention`` runs its C++ kernel (csrc/cpu_ops.cpp built)."""
    define_ops()
    return torch._C._dispatch_has_kernel("duoserve::attention_step")


@lru_cache(maxsize=1)
def decode_attention_op():
    """``duoserve::decode_attention`` with its C++ kernel (csrc/cpu_ops.cpp), or None without it."""
    define_ops()
    if not torch._C._dispatch_has_kernel_for_dispatch_key("duoserve::decode_attention", "CPU"):
        return None
    return torch.ops.duoserve.decode_attention.default


def decode_step_available() -> bool:
    """Whether ``duoserve::decode_step`` has its C++ kernel (csrc/cpu_ops.cpp built)."""
    define_ops()
    return torch._C._dispatch_has_kernel("duoserve::decode_step")


@lru_cache(maxsize=1)
def define_ops() -> torch.library.Library:
    lib = torch.library.Library("duoserve", "DEF")
    _define_linears(lib)
    _define_attention(lib)
    _define_glue(lib)
    lib.define("eager_module(Tensor x, int handle) -> Tensor")
    lib.impl("eager_module", _run_eager_module, "CPU")
    lib.impl("eager_module", lambda x, handle: x.new_empty(x.shape), "Meta")
    # a model whose decode steps run whole in C++ (csrc/decode_step.c; worker/fused_decode.py):
    # per layer its input norm, post norm, Gemma's attention-out and MLP-out norms and the q and k
    # norms (or empty tensors), packed qkv, qkv bias (or an empty tensor), packed o, gate_up and
    # down, K and V caches, and its scale, window and cap (0: none) and rope table (1: the local
    # one); its embedding table packed (PackedEmbedding); shape: hidden, heads, KV heads, head dim,
    # intermediate; gemma: Gemma's norms, MLP and embedding scale. From GGUF blocks: a projection's
    # packed slot empty, its runs' blocks in `blocks` with their type ids, `runs` the number of
    # runs of each layer's qkv, o, gate_up and down; the embedding's blocks of embed_type
    lib.define("decode_model(int context, Tensor[] layers, Tensor final_norm, Tensor cos, Tensor sin, "
               "Tensor local_cos, Tensor local_sin, Tensor embedding, int vocab, int[] shape, float eps, "
               "float[] scales, int[] windows, float[] caps, int[] local_layers, Tensor[] blocks, "
               "int[] block_types, int[] runs, int gguf_exact, int embed_type, int gemma, float embed_scale) -> ()")
    lib.define("decode_model_release(int context) -> ()")
    # a routed layer's MLP (its gate_up and down runs given as -1 to decode_model): the router, each
    # expert's gate_up, each expert's down, and a shared expert's gate_up, down and gate, each
    # packed or an empty tensor with its runs' blocks next in `blocks`; the experts' token counts
    lib.define("decode_model_moe(int context, int layer, Tensor[] weights, Tensor[] blocks, int[] block_types, "
               "int[] runs, int top_k, int renormalize, int inter, int shared_inter, Tensor expert_tokens, "
               "int gguf_exact) -> ()")
    # one decode step of that model: input_ids [rows] -> the final norm's output [rows, hidden]
    lib.define("decode_step(int context, Tensor input_ids, Tensor positions, Tensor slot_mapping, "
               "Tensor block_tables, Tensor seq_lens, Tensor row_adapter, Tensor lora_tables) -> Tensor")
    # LoRA adapters' updates added to a projection's output rows in place (csrc/lora.c): each row's
    # adapter (-1: none) indexes lora_tables, the addresses of the adapters' tables (worker/lora.py)
    lib.define("lora_rows(Tensor(a!) y, Tensor x, Tensor row_adapter, Tensor lora_tables, int index) -> ()")
    native = load_torch_op_library()  # csrc/cpu_ops.cpp: the C++ kernels of the linears and attention
    if not native:
        lib.impl("linear", linear_any_m, "CPU")
        lib.impl("packed_linear", c_packed_linear, "CPU")
        lib.impl("gguf_linear", gguf_linear, "CPU")
        lib.impl("paged_attention", layer_attention, "CPU")
    return lib


def _define_glue(lib: torch.library.Library) -> None:
    """A layer's small ops (``duoserve.kernels.glue``): one call each, never traced into; C++
    kernels only (every result contiguous, as the shape functions here say)."""
    lib.define("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor")
    lib.impl("rms_norm", lambda x, weight, eps: x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype)),
             "Meta")
    lib.define("rotary(Tensor x, Tensor cos, Tensor sin) -> Tensor")
    lib.impl("rotary", lambda x, cos, sin: x.new_empty(x.shape), "Meta")
    lib.define("silu_mul(Tensor gate_up) -> Tensor")
    lib.impl("silu_mul", lambda gate_up: gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2)), "Meta")
    lib.define("offset_rms_norm(Tensor x, Tensor weight, float eps) -> Tensor")   # Gemma's norm
    lib.impl("offset_rms_norm", lambda x, weight, eps: x.new_empty(x.shape), "Meta")
    lib.define("gelu_tanh_mul(Tensor gate_up) -> Tensor")   # Gemma's MLP
    lib.impl("gelu_tanh_mul", lambda gate_up: gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2)),
             "Meta")
    # a mixture of experts' routing and sums (model/moe.py): the chosen experts [tokens, top_k] and
    # their weights; an expert's weighted outputs added to its rows of out (in place); Qwen2-MoE's
    # shared expert behind its sigmoid gate
    lib.define("moe_route(Tensor logits, int top_k, bool renormalize) -> (Tensor, Tensor)")
    lib.impl("moe_route", lambda logits, top_k, renormalize: (
        logits.new_empty((logits.shape[0], top_k), dtype=torch.long), logits.new_empty((logits.shape[0], top_k))),
        "Meta")
    lib.define("expert_add(Tensor(a!) out, Tensor rows, Tensor y, Tensor weights) -> ()")
    lib.impl("expert_add", lambda out, rows, y, weights: None, "Meta")
    lib.define("shared_expert_add(Tensor out, Tensor gate, Tensor shared) -> Tensor")
    lib.impl("shared_expert_add", lambda out, gate, shared: out.new_empty(out.shape), "Meta")


def _define_linears(lib: torch.library.Library) -> None:
    lib.define("linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor")
    lib.impl("linear", lambda x, weight, bias: x.new_empty((*x.shape[:-1], weight.shape[0])), "Meta")
    # over a dense weight packed at load (dense.pack_linear_weight); n: the output features
    lib.define("packed_linear(Tensor x, Tensor packed, Tensor? bias, int n) -> Tensor")
    lib.impl("packed_linear", lambda x, packed, bias, n: x.new_empty((*x.shape[:-1], n), dtype=packed.dtype), "Meta")
    lib.define("gguf_linear(Tensor x, Tensor blocks, int type_id, int cols, str mode) -> Tensor")
    lib.impl("gguf_linear", lambda x, blocks, type_id, cols, mode: x.new_empty((*x.shape[:-1], blocks.shape[0])),
             "Meta")
    lib.define("gguf_embedding(Tensor ids, Tensor blocks, int type_id, int cols, ScalarType dtype) -> Tensor")
    lib.impl("gguf_embedding", gguf_embedding, "CPU")
    lib.impl("gguf_embedding", lambda ids, blocks, type_id, cols, dtype: ids.new_empty((*ids.shape, cols), dtype=dtype),
             "Meta")


def _define_attention(lib: torch.library.Library) -> None:
    lib.define("paged_attention(Tensor q, Tensor k, Tensor v, int context, int layer) -> Tensor")
    lib.impl("paged_attention", lambda q, k, v, context, layer: q.new_empty((q.shape[0], q.shape[1] * q.shape[2])),
             "Meta")
    # its Python kernel, which the C++ one calls for any step but an announced one
    lib.define("paged_attention_any(Tensor q, Tensor k, Tensor v, int context, int layer) -> Tensor")
    lib.impl("paged_attention_any", layer_attention, "CPU")
    # a compiled step announced to the C++ paged_attention (csrc/cpu_ops.cpp), and cleared after it
    # (slot_mapping None): its layers' caches and scales and the step's metadata
    lib.define("attention_step(int context, Tensor[] k_caches, Tensor[] v_caches, Tensor? slot_mapping, "
               "Tensor? block_tables, Tensor? seq_lens, float[] scales, int[] windows, float[] caps) -> ()")
    # a decode step's attention of one layer, KV written in place: C++ only (csrc/cpu_ops.cpp); without
    # it the C attention backend makes the same calls from Python
    lib.define("decode_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, "
               "Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, float scale, int window, "
               "float cap) -> Tensor")
