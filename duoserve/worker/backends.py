"""Where the kernels meet the model: the CPU backends put into the plain model at the edge.

The model (``duoserve.model``) is plain torch and knows no kernel; ``duoserve.kernels`` knows
no model. Here, once per model:

* at load, ``--quantization gguf`` builds the linears and the embedding that a GGUF file holds
  in blocks as ``GGUFLinear`` / ``GGUFEmbedding`` (the dense weight never exists), and
  ``--quantization int8`` replaces every linear by an ``Int8Linear`` (``load_model``);
* in the runner, on the CPU, every remaining ``nn.Linear`` becomes a ``CPULinear`` (one
  ``replace_linears`` call; a tied embedding then reads the head's packed copy) and every
  layer's attention the C kernels' ``CAttention`` where they read the KV cache's dtype, and
  every norm, rotary and SiLU-and-multiply an op call (``use_cpu_kernels``; ``kernels/glue.py``:
  eager and compiled steps then compute the same bits). The compiled step and the C++ decode
  step build on these.
"""

from __future__ import annotations

import functools
import logging

import torch
from torch import nn

from duoserve.config import ModelConfig
from duoserve.heap import release_free_memory
from duoserve.kernels.attention import CAttention, c_attention_serves
from duoserve.kernels.dense import onednn_available
from duoserve.kernels.gguf import BLOCK_TYPES
from duoserve.kernels.glue import (OpExpertSum, OpGeluTanhAndMul, OpOffsetRMSNorm, OpRMSNorm, OpRotary,
                                   OpSharedExpertAdd, OpSiluAndMul, OpTopKRouting, glue_ops_available)
from duoserve.kernels.linear import (CPULinear, GGUFEmbedding, GGUFLinear, PackedEmbedding, cpu_linear, int8_linear,
                                     replace_linears)
from duoserve.model.layers import GeluTanhAndMul, OffsetRMSNorm, RMSNorm, Rotary, SiluAndMul
from duoserve.model.loader import LoadedModel, load_checkpoint, resolve_model_path, weight_bytes
from duoserve.model.moe import ExpertSum, SharedExpertAdd, TopKRouting
from duoserve.model.weights import BlockModules
from duoserve.platform import RunTime, resolve

logger = logging.getLogger(__name__)


def gguf_block_modules(dtype: torch.dtype, mode: str) -> BlockModules:
    """The GGUF block modules of ``--gguf-mode`` ``mode`` for a model of ``dtype``."""
    return BlockModules(types=frozenset(BLOCK_TYPES), linear=functools.partial(GGUFLinear, bias=None, mode=mode),
                        embedding=functools.partial(GGUFEmbedding, dtype=dtype),
                        tied_embedding=functools.partial(GGUFEmbedding.reading_head, dtype=dtype))


def load_model(config: ModelConfig, runtime: RunTime | None = None) -> LoadedModel:
    """The model of ``config`` with its weights as ``--quantization`` says: GGUF blocks kept as
    they are, int8, or dense (``auto``: blocks for a .gguf file on the CPU). ``runtime``: what the
    config's ``auto`` values mean here, as the builder resolved them (resolved now without it)."""
    runtime = runtime or resolve(config, resolve_model_path(config.model))
    quantization = runtime.quantization
    blocks = gguf_block_modules(runtime.torch_dtype, config.gguf_mode) if quantization == "gguf" else None
    label = f"gguf-{config.gguf_mode}" if quantization == "gguf" else quantization
    loaded = load_checkpoint(config, runtime, blocks, label)
    if quantization == "int8":
        replace_linears(loaded.model, int8_linear)
    logger.info("weights in memory: %s", ", ".join(f"{kind} {size / 2**20:.1f} MB"
                                                   for kind, size in weight_bytes(loaded.model).items() if size))
    return loaded


def use_cpu_kernels(model: nn.Module, kv_dtype: torch.dtype) -> None:
    """Swap the CPU kernels into a CPU model: its linears (a tied output projection's included),
    its norms, rotary and activations and, where the C kernels read ``kv_dtype``, its layers'
    attention."""
    if onednn_available():
        replace_linears(model, cpu_linear)
        head, embed = getattr(model, "lm_head", None), getattr(model, "embed", None)
        if (model.arch.tie_word_embeddings and isinstance(head, CPULinear) and head.packed is not None
                and isinstance(embed, nn.Embedding)):
            model.embed = PackedEmbedding.of_head(head)   # one copy of the table: the packed one
        elif isinstance(embed, nn.Embedding) and embed.weight.device.type == "cpu":
            # untied: the table packed in place of the plain one (the C++ decode step reads it so)
            model.embed = PackedEmbedding.of_table(embed.weight) or embed
        del head, embed
        release_free_memory()
    else:
        logger.info("oneDNN is not available: CPU matmuls use plain F.linear")
    if c_attention_serves("cpu", kv_dtype):
        for layer in model.layers:
            layer.attn = CAttention(layer.attn)
    use_glue_ops(model)


def use_glue_ops(model: nn.Module) -> None:
    """Each ``RMSNorm`` (Gemma's ``OffsetRMSNorm`` too), ``Rotary``, ``SiluAndMul`` and
    ``GeluTanhAndMul`` of the model (a mixture of experts' ``TopKRouting``, ``ExpertSum`` and
    ``SharedExpertAdd``) becomes its op call, where the
    ops are built (without them there is no compiled step to differ from the eager one)."""
    if not glue_ops_available():
        return
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            op = next((make(child) for kind, make in _GLUE_OPS if isinstance(child, kind)), None)
            if op is not None:
                setattr(parent, name, op)


# each module of model/layers.py and model/moe.py with an op, and how its op is made from it
_GLUE_OPS = (
    (RMSNorm, lambda m: OpRMSNorm(m.weight, m.eps)),
    (OffsetRMSNorm, lambda m: OpOffsetRMSNorm(m.weight, m.eps)),
    (GeluTanhAndMul, lambda m: OpGeluTanhAndMul()),
    (Rotary, lambda m: OpRotary()),
    (SiluAndMul, lambda m: OpSiluAndMul()),
    (TopKRouting, lambda m: OpTopKRouting(m.top_k, m.renormalize)),
    (ExpertSum, lambda m: OpExpertSum()),
    (SharedExpertAdd, lambda m: OpSharedExpertAdd()),
)
