"""Assemble the model's (fused) parameters from checkpoint tensors named as Hugging Face names them.

Both loaders present their tensors under Hugging Face names (the GGUF loader renames
and un-permutes); this module checks each one's presence and shape, fuses Q/K/V and
gate/up, and assigns the result to a model built on the meta device.
"""

from __future__ import annotations

import contextlib

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from duoserve.errors import ModelLoadError
from duoserve.model.arch import FUSED_CHECKPOINTS, ModelArch
from duoserve.model.gemma import GemmaModel
from duoserve.model.gguf_loader import GGUFBlocks
from duoserve.model.llama import LlamaModel
from duoserve.model.moe import MoEModel

# ModelArch.family -> the model class that builds it
MODEL_CLASSES: dict[str, type[nn.Module]] = {"llama": LlamaModel, "gemma": GemmaModel, "moe": MoEModel}

# ModelArch.family -> (our norm name, the checkpoint's) of each layer's norms besides input_norm
_LAYER_NORMS = {
    "llama": [("post_norm", "post_attention_layernorm")],
    "moe": [("post_norm", "post_attention_layernorm")],
    "gemma": [("post_attn_norm", "post_attention_layernorm"), ("pre_ffn_norm", "pre_feedforward_layernorm"),
               ("post_ffn_norm", "post_feedforward_layernorm")],
}

TensorSource = Callable[[str], "torch.Tensor | None"]


@dataclass(frozen=True)
class BlockModules:
    """Modules that compute from GGUF blocks, given by the caller (the runner's kernels): the
    model is built with them where a dense parameter would go, so the dense weight never exists."""
    types: frozenset[str]                            # the block types they compute from; others load dense
    linear: Callable[[list[GGUFBlocks]], nn.Module]  # a (fused) projection from its parts' blocks
    embedding: Callable[[GGUFBlocks], nn.Module]     # the embedding table from its blocks
    # a tied output projection's embedding over the projection's own bytes where it changed their
    # layout (so that the table is held once), else None: the embedding keeps the file's blocks
    tied_embedding: Callable[[nn.Module], nn.Module | None] = lambda head: None


def checkpoint_parts(arch: ModelArch) -> dict[str, list[tuple[str, tuple[int, ...]]]]:
    """Our parameter name -> the checkpoint tensors (HF names, shapes) it is made of, in order."""
    h, q, kv, inter = arch.hidden_size, arch.q_size, arch.kv_size, arch.intermediate_size
    fused = arch.architecture in FUSED_CHECKPOINTS
    parts: dict[str, list[tuple[str, tuple[int, ...]]]] = {
        "embed.weight": [("model.embed_tokens.weight", (arch.vocab_size, h))],
    }
    for i in range(arch.num_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        parts[dst + "input_norm.weight"] = [(src + "input_layernorm.weight", (h,))]
        parts[dst + "qkv.weight"] = [(src + "self_attn.qkv_proj.weight", (q + 2 * kv, h))] if fused else [
            (src + "self_attn.q_proj.weight", (q, h)), (src + "self_attn.k_proj.weight", (kv, h)),
            (src + "self_attn.v_proj.weight", (kv, h))]
        if arch.qkv_bias:
            parts[dst + "qkv.bias"] = [(src + "self_attn.q_proj.bias", (q,)),
                                       (src + "self_attn.k_proj.bias", (kv,)),
                                       (src + "self_attn.v_proj.bias", (kv,))]
        if arch.qk_norm:
            parts[dst + "q_norm.weight"] = [(src + "self_attn.q_norm.weight", (arch.head_dim,))]
            parts[dst + "k_norm.weight"] = [(src + "self_attn.k_norm.weight", (arch.head_dim,))]
        parts[dst + "o_proj.weight"] = [(src + "self_attn.o_proj.weight", (h, q))]
        for ours, theirs in _LAYER_NORMS[arch.family]:
            parts[dst + ours + ".weight"] = [(src + theirs + ".weight", (h,))]
        if arch.routed(i):
            parts.update(_routed_mlp_parts(arch, src, dst + "moe."))
            continue
        # a fused checkpoint's gate_up_proj holds the gate rows, then the up rows: our layout
        parts[dst + "gate_up.weight"] = [(src + "mlp.gate_up_proj.weight", (2 * inter, h))] if fused else [
            (src + "mlp.gate_proj.weight", (inter, h)), (src + "mlp.up_proj.weight", (inter, h))]
        parts[dst + "down.weight"] = [(src + "mlp.down_proj.weight", (h, inter))]
    parts["norm.weight"] = [("model.norm.weight", (h,))]
    if not arch.tie_word_embeddings:
        parts["lm_head.weight"] = [("lm_head.weight", (arch.vocab_size, h))]
    return parts


def _routed_mlp_parts(arch: ModelArch, src: str, dst: str) -> dict[str, list[tuple[str, tuple[int, ...]]]]:
    """A routed MLP's router, experts and shared expert, under Mixtral's names (``block_sparse_moe``,
    w1 gate, w3 up, w2 down) or Qwen's (``mlp``, gate/up/down_proj)."""
    h, inter = arch.hidden_size, arch.moe_intermediate_size
    mixtral = arch.architecture == "MixtralForCausalLM"
    block = src + ("block_sparse_moe." if mixtral else "mlp.")
    gate, up, down = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    parts = {}
    for e in range(arch.num_experts):
        expert = f"{block}experts.{e}."
        parts[f"{dst}experts.{e}.gate_up.weight"] = [(expert + gate + ".weight", (inter, h)),
                                                     (expert + up + ".weight", (inter, h))]
        parts[f"{dst}experts.{e}.down.weight"] = [(expert + down + ".weight", (h, inter))]
    # after the experts: a GGUF file's expert count is checked against its stacked tensors first
    parts[dst + "router.weight"] = [(block + "gate.weight", (arch.num_experts, h))]
    shared = arch.shared_expert_intermediate_size
    if shared:
        parts[dst + "shared.gate_up.weight"] = [(block + "shared_expert.gate_proj.weight", (shared, h)),
                                                (block + "shared_expert.up_proj.weight", (shared, h))]
        parts[dst + "shared.down.weight"] = [(block + "shared_expert.down_proj.weight", (h, shared))]
        parts[dst + "shared_gate.weight"] = [(block + "shared_expert_gate.weight", (1, h))]
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


_BLOCK_PARAMS = ("qkv.weight", "o_proj.weight", "gate_up.weight", "down.weight", "lm_head.weight", "embed.weight")


_INITS = ("normal_", "uniform_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_", "xavier_normal_",
          "trunc_normal_", "zeros_", "ones_", "constant_")


@contextlib.contextmanager
def _no_init():
    """Modules built on the meta device skip their random initialization (every parameter comes
    from the checkpoint): on meta tensors torch.nn.init runs torch's Python reference kernels,
    whose first call imports torch.compile's stack (a second of every engine's start)."""
    saved = {name: getattr(nn.init, name) for name in _INITS}
    for name in _INITS:
        setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for name, function in saved.items():
            setattr(nn.init, name, function)


def build_model(arch: ModelArch, source: TensorSource, dtype: torch.dtype, device: str,
                max_positions: int | None = None, blocks: BlockModules | None = None) -> nn.Module:
    """Build the model on ``device`` with every parameter taken from ``source``. With ``blocks``,
    linear weights and the embedding that the source holds as GGUF blocks of ``blocks.types``
    stay in blocks, in ``blocks``' modules; a tied output projection then reads the embedding's."""
    with torch.device("meta"), _no_init():
        model = MODEL_CLASSES[arch.family](arch, with_rotary=False)   # its tables once loaded, below
    embed_blocks = None
    # One parameter at a time, straight to the device: the peak is the model plus one tensor.
    for name, pieces in checkpoint_parts(arch).items():
        parts = _block_parts(pieces, source, blocks.types) if blocks and name.endswith(_BLOCK_PARAMS) else None
        if parts is not None:
            owner = name.removesuffix(".weight")
            if owner == "embed":
                embed_blocks = parts[0]
            _set_submodule(model, owner, blocks.embedding(parts[0]) if owner == "embed" else blocks.linear(parts))
            continue
        tensors = [_fetch(source, src, shape, dtype) for src, shape in pieces]
        value = tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=0)
        owner, _, attr = name.rpartition(".")
        setattr(model.get_submodule(owner), attr, nn.Parameter(value.to(device), requires_grad=False))
        del tensors, value
    if arch.tie_word_embeddings and embed_blocks is not None:
        model.lm_head = blocks.linear([embed_blocks])
        model.embed = blocks.tied_embedding(model.lm_head) or model.embed
    elif arch.tie_word_embeddings:
        model.lm_head.weight = model.embed.weight   # loading replaced the parameter the two shared
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    assert not missing, f"parameters left unloaded: {missing}"
    model.set_rotary(max_positions or arch.max_position_embeddings)
    return model.to(device).eval()


def _block_parts(pieces: list[tuple[str, tuple[int, ...]]], source: TensorSource,
                 types: frozenset[str]) -> list[GGUFBlocks] | None:
    """The blocks of every piece of a parameter, or None unless the source holds each in blocks."""
    blocks_of = getattr(source, "blocks", None)
    if blocks_of is None:
        return None
    parts = []
    for src, shape in pieces:
        part = blocks_of(src, types)
        if part is None:
            return None
        if (part.rows, part.cols) != shape:
            raise ModelLoadError(f"checkpoint tensor {src} has shape {[part.rows, part.cols]}, expected {list(shape)}")
        parts.append(part)
    return parts


def _set_submodule(model: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, attr = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, attr, module)
