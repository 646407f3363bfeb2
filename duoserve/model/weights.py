"""Assemble the model's (fused) parameters from checkpoint tensors named as Hugging Face names them.

Both loaders present their tensors under Hugging Face names (the GGUF loader renames
and un-permutes); this module checks each one's presence and shape, fuses Q/K/V and
gate/up, and assigns the result to a model built on the meta device.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from duoserve.errors import ModelLoadError
from duoserve.model.arch import ModelArch
from duoserve.model.llama import LlamaModel
from duoserve.model.layers import RotaryEmbedding
from duoserve.model.quantized import GGUFEmbedding, GGUFLinear

TensorSource = Callable[[str], "torch.Tensor | None"]


def checkpoint_parts(arch: ModelArch) -> dict[str, list[tuple[str, tuple[int, ...]]]]:
    """Our parameter name -> the checkpoint tensors (HF names, shapes) it is made of, in order."""
    h, q, kv, inter = arch.hidden_size, arch.q_size, arch.kv_size, arch.intermediate_size
    parts: dict[str, list[tuple[str, tuple[int, ...]]]] = {
        "embed.weight": [("model.embed_tokens.weight", (arch.vocab_size, h))],
    }
    for i in range(arch.num_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        parts[dst + "input_norm.weight"] = [(src + "input_layernorm.weight", (h,))]
        parts[dst + "qkv.weight"] = [(src + "self_attn.q_proj.weight", (q, h)),
                                     (src + "self_attn.k_proj.weight", (kv, h)),
                                     (src + "self_attn.v_proj.weight", (kv, h))]
        if arch.qkv_bias:
            parts[dst + "qkv.bias"] = [(src + "self_attn.q_proj.bias", (q,)),
                                       (src + "self_attn.k_proj.bias", (kv,)),
                                       (src + "self_attn.v_proj.bias", (kv,))]
        if arch.qk_norm:
            parts[dst + "q_norm.weight"] = [(src + "self_attn.q_norm.weight", (arch.head_dim,))]
            parts[dst + "k_norm.weight"] = [(src + "self_attn.k_norm.weight", (arch.head_dim,))]
        parts[dst + "o_proj.weight"] = [(src + "self_attn.o_proj.weight", (h, q))]
        parts[dst + "post_norm.weight"] = [(src + "post_attention_layernorm.weight", (h,))]
        parts[dst + "gate_up.weight"] = [(src + "mlp.gate_proj.weight", (inter, h)),
                                         (src + "mlp.up_proj.weight", (inter, h))]
        parts[dst + "down.weight"] = [(src + "mlp.down_proj.weight", (h, inter))]
    parts["norm.weight"] = [("model.norm.weight", (h,))]
    if not arch.tie_word_embeddings:
        parts["lm_head.weight"] = [("lm_head.weight", (arch.vocab_size, h))]
    return parts


def _fetch(source: TensorSource, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    tensor = source(name)
    if tensor is None:
        raise ModelLoadError(f"checkpoint tensor {name} is missing (expected shape {list(shape)})")
    if tuple(tensor.shape) != shape:
        raise ModelLoadError(
            f"checkpoint tensor {name} has shape {list(tensor.shape)}, expected {list(shape)}"
        )
    return tensor.to(dtype)


_PACKABLE = ("qkv.weight", "o_proj.weight", "gate_up.weight", "down.weight", "lm_head.weight", "embed.weight")


def build_model(arch: ModelArch, source: TensorSource, dtype: torch.dtype, device: str,
                max_positions: int | None = None, packed_mode: str | None = None) -> LlamaModel:
    """Build the model on ``device`` with every parameter taken from ``source``. With ``packed_mode``
    (``fast`` or ``exact``), linear weights and the embedding that the source holds as GGUF blocks
    stay packed (``duoserve.model.quantized``)."""
    with torch.device("meta"):
        model = LlamaModel(arch)
    # One parameter at a time, straight to the device: the peak is the model plus one tensor.
    for name, pieces in checkpoint_parts(arch).items():
        if packed_mode and name.endswith(_PACKABLE) and _install_packed(model, name, pieces, source, dtype, packed_mode):
            continue
        tensors = [_fetch(source, src, shape, dtype) for src, shape in pieces]
        value = tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=0)
        owner, _, attr = name.rpartition(".")
        setattr(model.get_submodule(owner), attr, nn.Parameter(value.to(device), requires_grad=False))
        del tensors, value
    if packed_mode and arch.tie_word_embeddings and isinstance(model.embed, GGUFEmbedding):
        model.tied_head = GGUFLinear([model.embed.packed], None, packed_mode)
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    assert not missing, f"parameters left unloaded: {missing}"
    model.rotary = RotaryEmbedding(arch.head_dim, max_positions or arch.max_position_embeddings, arch.rope)
    return model.to(device).eval()


def _install_packed(model: LlamaModel, name: str, pieces: list[tuple[str, tuple[int, ...]]], source: TensorSource,
                    dtype: torch.dtype, mode: str) -> bool:
    """Put a packed module where ``name``'s dense parameter would go, if every piece is in blocks."""
    packed_of = getattr(source, "packed", None)
    if packed_of is None:
        return False
    parts = []
    for src, shape in pieces:
        part = packed_of(src)
        if part is None:
            return False
        if (part.rows, part.cols) != shape:
            raise ModelLoadError(f"checkpoint tensor {src} has shape {[part.rows, part.cols]}, expected {list(shape)}")
        parts.append(part)
    owner, _, _ = name.rpartition(".")
    parent, _, attr = owner.rpartition(".")
    module = GGUFEmbedding(parts[0], dtype) if attr == "embed" else GGUFLinear(parts, None, mode)
    setattr(model.get_submodule(parent) if parent else model, attr, module)
    return True
