"""Load a GGUF file: hyper-parameters and tokenizer from its metadata, tensors dequantized.

GGUF names tensors llama.cpp's way (``blk.3.attn_q.weight``) and, for the ``llama``
architecture, stores Q and K with their rows permuted for interleaved rotary; we
rename to Hugging Face names and undo the permutation so one model serves both.
llama.cpp's Gemma converter stores every norm weight plus one (its RMSNorm multiplies
by the weight itself); we subtract it again, as transformers does. A mixture of experts stores each
layer's experts stacked in one tensor per projection (``ffn_gate_exps``: [experts, rows, cols]);
each expert is a contiguous run of its blocks, presented as a tensor of its own
(``...experts.3.gate_proj.weight``) and computed in place like any other.
"""

from __future__ import annotations

import dataclasses
import mmap
import warnings
from collections.abc import Collection
from pathlib import Path
from typing import Any

import numpy as np
import torch

from duoserve.errors import ConfigError, ModelLoadError
from duoserve.model.arch import ModelArch, RopeConfig, apply_overrides, arch_from_hf_config
from duoserve.model.dequant import dequantize
from duoserve.model.rope_params import yarn_mscale
from duoserve.model.gguf_file import GGUFFile, read_gguf


@dataclasses.dataclass
class GGUFBlocks:
    """A [rows, cols] weight as the raw GGUF blocks of the file: ``data`` is [rows, bytes per row]
    uint8, ``type_name`` GGUF's name of the block type (Q4_0, Q6_K, ...)."""
    data: torch.Tensor
    type_name: str
    rows: int
    cols: int

    @property
    def nbytes(self) -> int:
        return self.data.numel()

_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                  "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM",
                  "qwen2moe": "Qwen2MoeForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM", "phi3": "Phi3ForCausalLM"}

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# where Gemma's sandwich norms differ: ffn_norm is the norm before its MLP, not after attention
_GEMMA_LAYER_NAMES = {
    **_LAYER_NAMES,
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
# a mixture of experts' tensors under Qwen's names; Mixtral's router is block_sparse_moe.gate and its
# experts' projections w1, w3, w2 (_MIXTRAL_PROJECTIONS); a stacked tensor gives one name per expert
_MOE_NAMES = {
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
}
# Phi-3 keeps its checkpoint's fused projections: attn_qkv, and ffn_up holding gate then up
_PHI3_LAYER_NAMES = {**_LAYER_NAMES, "attn_qkv.weight": "self_attn.qkv_proj.weight",
                     "ffn_up.weight": "mlp.gate_up_proj.weight"}
_STACKED_EXPERTS = {"ffn_gate_exps.weight": "gate_proj", "ffn_up_exps.weight": "up_proj",
                    "ffn_down_exps.weight": "down_proj"}
_MIXTRAL_PROJECTIONS = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}


def hf_names(gguf_name: str, gguf_arch: str = "llama", num_experts: int = 0,
             mixtral: bool = False) -> list[tuple[str, int | None]]:
    """The Hugging Face tensors a GGUF tensor holds, each with its expert's index in a stacked
    tensor (None for a tensor of its own); none for a tensor the model does not read."""
    if gguf_name in _GLOBAL_NAMES:
        return [(_GLOBAL_NAMES[gguf_name], None)]
    names = (_GEMMA_LAYER_NAMES if gguf_arch.startswith("gemma") else _PHI3_LAYER_NAMES if gguf_arch == "phi3"
             else {**_LAYER_NAMES, **_MOE_NAMES})
    parts = gguf_name.split(".", 2)
    if len(parts) != 3 or parts[0] != "blk":
        return []
    layer = f"model.layers.{parts[1]}."
    if parts[2] in _STACKED_EXPERTS and num_experts:
        projection = _STACKED_EXPERTS[parts[2]]
        if mixtral:
            return [(f"{layer}block_sparse_moe.experts.{e}.{_MIXTRAL_PROJECTIONS[projection]}.weight", e)
                    for e in range(num_experts)]
        return [(f"{layer}mlp.experts.{e}.{projection}.weight", e) for e in range(num_experts)]
    if parts[2] not in names:
        return []
    name = names[parts[2]]
    if mixtral and name == "mlp.gate.weight":
        name = "block_sparse_moe.gate.weight"
    return [(layer + name, None)]


def _hf_config_from_gguf(meta: dict[str, Any], tensor_names: set[str]) -> dict[str, Any]:
    """A config.json-shaped dict, so ``hf_overrides`` and validation work the same for GGUF."""
    gguf_arch = meta.get("general.architecture")
    if gguf_arch not in _ARCHITECTURES:
        raise ConfigError("general.architecture", gguf_arch,
                          f"supported GGUF architectures are {', '.join(_ARCHITECTURES)}")
    p = f"{gguf_arch}."
    heads = int(meta[p + "attention.head_count"])
    hidden = int(meta[p + "embedding_length"])
    vocab = meta.get(p + "vocab_size") or len(meta.get("tokenizer.ggml.tokens") or [])
    config: dict[str, Any] = {
        "architectures": [_ARCHITECTURES[gguf_arch]],
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(meta[p + "feed_forward_length"]),
        "num_hidden_layers": int(meta[p + "block_count"]),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get(p + "attention.head_count_kv", heads)),
        "head_dim": int(meta.get(p + "attention.key_length", hidden // heads)),
        "rms_norm_eps": float(meta.get(p + "attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(meta.get(p + "rope.freq_base", 10000.0)),
        "max_position_embeddings": int(meta.get(p + "context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
    }
    config.update(_experts(meta, p, gguf_arch, config["intermediate_size"]))
    scaling = _rope_scaling(meta, p, tensor_names)
    if scaling:
        config["rope_scaling"] = scaling
    if gguf_arch == "phi3" and meta.get(p + "attention.sliding_window"):
        config["sliding_window"] = int(meta[p + "attention.sliding_window"])
    if gguf_arch in ("gemma2", "gemma3"):
        config.update(_gemma(meta, p, gguf_arch, config, hidden // heads))
    return config


def _experts(meta: dict[str, Any], p: str, gguf_arch: str, intermediate: int) -> dict[str, Any]:
    """A mixture of experts' config keys (none for a dense model). Mixtral is llama with experts
    (each expert the dense MLP's size); Qwen MoE states the experts' and shared expert's sizes,
    and llama.cpp renormalizes Qwen3-MoE's top-k, not Qwen2-MoE's."""
    experts = int(meta.get(p + "expert_count") or 0)
    if not experts:
        return {}
    return dict(num_experts=experts, num_local_experts=experts,
                num_experts_per_tok=int(meta[p + "expert_used_count"]),
                moe_intermediate_size=int(meta.get(p + "expert_feed_forward_length") or intermediate),
                shared_expert_intermediate_size=int(meta.get(p + "expert_shared_feed_forward_length") or 0),
                norm_topk_prob=bool(meta.get(p + "expert_weights_norm", gguf_arch != "qwen2moe")),
                **({"architectures": ["MixtralForCausalLM"]} if gguf_arch == "llama" else {}))


def _gemma(meta: dict[str, Any], p: str, gguf_arch: str, config: dict[str, Any], hidden_per_head: int
           ) -> dict[str, Any]:
    """What llama.cpp fixes for Gemma rather than stores: the tanh GELU, the attention scale from
    the head size (hidden / heads for the 27B models: 46 layers in Gemma 2, 62 in Gemma 3) unless
    the file states a scale; Gemma 2 alternates local and global layers and caps its scores and
    logits, Gemma 3 has five local layers to one global with a local rope base of 10000."""
    big = {"gemma2": 46, "gemma3": 62}[gguf_arch]
    scalar = hidden_per_head if config["num_hidden_layers"] == big else config["head_dim"]
    if meta.get(p + "attention.scale"):
        scalar = float(meta[p + "attention.scale"]) ** -2
    keys = dict(hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=scalar,
                sliding_window=int(meta[p + "attention.sliding_window"]))
    if gguf_arch == "gemma2":
        return dict(keys, sliding_window_pattern=2, attn_logit_softcapping=meta.get(p + "attn_logit_softcapping"),
                    final_logit_softcapping=meta.get(p + "final_logit_softcapping"))
    return dict(keys, rope_local_base_freq=10000.0,
                sliding_window_pattern=int(meta.get(p + "attention.sliding_window_pattern", 6)))


def _rope_scaling(meta: dict[str, Any], p: str, tensor_names: set[str]) -> dict[str, Any] | None:
    """config.json's rope_scaling from llama.cpp's keys (``{arch}.rope.scaling.*``); None without
    scaling. llama.cpp scales YaRN's cos and sin by ``attn_factor`` times YaRN's own factor;
    longrope (Phi-3) is its factor tensors, read by ``_longrope``."""
    kind = meta.get(p + "rope.scaling.type")
    if _LONGROPE_TENSORS[0] in tensor_names:
        if kind not in (None, "none", "longrope"):
            raise ConfigError(p + "rope.scaling.type", kind, "longrope, or absent, beside rope_factors_long")
        return {"rope_type": "longrope", "original_max_position_embeddings":
                meta.get(p + "rope.scaling.original_context_length"),
                **({"attention_factor": float(meta[p + "rope.scaling.attn_factor"])}
                   if meta.get(p + "rope.scaling.attn_factor") is not None else {})}
    if kind in (None, "none"):
        return None
    factor = meta.get(p + "rope.scaling.factor")
    original = meta.get(p + "rope.scaling.original_context_length")
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn":
        for key in ("yarn_log_multiplier", "yarn_ext_factor", "yarn_attn_factor"):
            if meta.get(p + "rope.scaling." + key) is not None:
                raise ConfigError(p + "rope.scaling." + key, meta[p + "rope.scaling." + key],
                                  "absent: duoserve computes YaRN as transformers does, without it")
        scaling = {"rope_type": "yarn", "factor": float(factor), "original_max_position_embeddings": original}
        for key, name in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            if meta.get(p + "rope.scaling." + key) is not None:
                scaling[name] = float(meta[p + "rope.scaling." + key])
        if meta.get(p + "rope.scaling.attn_factor") is not None:
            scaling["attention_factor"] = float(meta[p + "rope.scaling.attn_factor"]) * yarn_mscale(float(factor))
        return scaling
    raise ConfigError(p + "rope.scaling.type", kind,
                      "supported GGUF rope scalings are none, linear, yarn, longrope (with its factor tensors)")


_LONGROPE_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")


def _longrope(reader: GGUFFile, config: dict[str, Any]) -> None:
    """Phi-3's long and short factors, stored as tensors, into config's rope_scaling."""
    tensors = {t.name: t for t in reader.tensors}
    if _LONGROPE_TENSORS[0] not in tensors or "rope_scaling" not in config:
        return
    if _LONGROPE_TENSORS[1] not in tensors:
        raise ModelLoadError(f"GGUF tensor {_LONGROPE_TENSORS[1]} is missing beside {_LONGROPE_TENSORS[0]}")
    for key, name in zip(("long_factor", "short_factor"), _LONGROPE_TENSORS):
        config["rope_scaling"][key] = [float(x) for x in np.asarray(tensors[name].data).view(np.float32)]


class GGUFSource:
    """Dequantized tensors of a GGUF file under Hugging Face names."""

    def __init__(self, reader: GGUFFile, arch: ModelArch, permuted_qk: bool, gguf_arch: str = "llama") -> None:
        self._tensors: dict[str, tuple[Any, int | None]] = {}   # HF name -> (GGUF tensor, expert or None)
        self._by_file_name = {tensor.name: tensor for tensor in reader.tensors}
        mixtral = arch.architecture == "MixtralForCausalLM"
        for tensor in reader.tensors:
            for name, expert in hf_names(tensor.name, gguf_arch, arch.num_experts, mixtral):
                self._tensors[name] = (tensor, expert)
        self._arch = arch
        self._permuted_qk = permuted_qk
        self._norms_plus_one = gguf_arch.startswith("gemma")

    def file_tensor(self, gguf_name: str) -> torch.Tensor | None:
        """A tensor under the file's own name, dequantized (one no model layer reads: ``cls.output``)."""
        tensor = self._by_file_name.get(gguf_name)
        if tensor is None:
            return None
        shape = tuple(int(d) for d in reversed(tensor.shape))
        return dequantize(np.asarray(tensor.data), tensor.tensor_type.name, shape, tensor.name)

    def file_rows(self, gguf_name: str, rows: list[int]) -> torch.Tensor | None:
        """Some rows of a matrix under the file's own name, dequantized (a row's blocks are contiguous)."""
        tensor = self._by_file_name.get(gguf_name)
        if tensor is None:
            return None
        num_rows, cols = int(tensor.shape[-1]) if len(tensor.shape) > 1 else 1, int(tensor.shape[0])
        row_bytes = tensor.data.size // num_rows
        raw = np.concatenate([tensor.data[r * row_bytes:(r + 1) * row_bytes] for r in rows])
        return dequantize(raw, tensor.tensor_type.name, (len(rows), cols), tensor.name)

    def _raw(self, name: str) -> tuple[Any, np.ndarray, tuple[int, ...]] | None:
        """The GGUF tensor holding ``name``, the bytes of ``name`` in it and its shape (outermost first)."""
        if name not in self._tensors:
            return None
        tensor, expert = self._tensors[name]
        shape = tuple(int(d) for d in reversed(tensor.shape))
        if expert is None:
            return tensor, tensor.data, shape
        if len(shape) != 3 or shape[0] != self._arch.num_experts:
            raise ModelLoadError(f"GGUF tensor {tensor.name} has shape {list(shape)}, expected "
                                 f"[{self._arch.num_experts}, rows, cols] (one matrix per expert)")
        per_expert = tensor.data.size // shape[0]   # [experts, rows, cols]: an expert's rows are contiguous
        return tensor, tensor.data[expert * per_expert: (expert + 1) * per_expert], shape[1:]

    def __call__(self, name: str) -> torch.Tensor | None:
        found = self._raw(name)
        if found is None:
            return None
        tensor, raw, shape = found
        values = dequantize(np.asarray(raw), tensor.tensor_type.name, shape, tensor.name)
        if name.endswith("shared_expert_gate.weight") and values.dim() == 1:
            values = values.unsqueeze(0)   # llama.cpp stores the shared expert's gate as a vector
        if self._permuted_qk and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = self._arch.num_heads if "q_proj" in name else self._arch.num_kv_heads
            values = _unpermute(values, heads)
        if self._norms_plus_one and name.endswith("norm.weight"):
            values = values - 1.0
        return values

    def blocks(self, name: str, types: Collection[str]) -> GGUFBlocks | None:
        """The tensor ``name`` as its raw GGUF blocks, if it is 2-d and of one of the block ``types``."""
        found = self._raw(name)
        if found is None or found[0].tensor_type.name not in types or len(found[2]) != 2:
            return None
        tensor, raw, (rows, cols) = found
        if self._permuted_qk and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = self._arch.num_heads if "q_proj" in name else self._arch.num_kv_heads
            data = _unpermute(torch.from_numpy(np.array(raw, copy=True)).reshape(rows, -1), heads).contiguous()
        else:   # an embedding table is read a row a token: its pages come in as tokens need them
            data = _mapped(raw, touch=name != "model.embed_tokens.weight").reshape(rows, -1)
        return GGUFBlocks(data, tensor.tensor_type.name, rows, cols)


def _mapped(raw: np.ndarray, touch: bool = True) -> torch.Tensor:
    """A uint8 tensor over the file's own pages (its read-only map: no second copy of the weights,
    and pages the kernel can drop and read again). Nothing writes to blocks; a write would fault
    rather than change the file. torch warns that it could not write there, said once here. With
    ``touch``, each page is read once now, so the weights are resident before the memory report
    counts them and the first request does not fault them in one by one (a projection reads every
    page each step); without, only the pages read become resident (an embedding's rows: a
    151,936-token table of 94 MB holds a few MB of them for a run of English prompts)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        data = torch.from_numpy(raw)
    if touch:
        int(data[::_PAGE].sum())
    return data


_PAGE = mmap.PAGESIZE


def _unpermute(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's per-head row permutation (interleaved -> rotate-half rotary layout)."""
    rows = weight.shape[0]
    return (weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
            .transpose(1, 2).reshape(weight.shape))


def read_header(path: Path) -> GGUFFile:
    try:
        return read_gguf(path)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path} is not a readable GGUF file: {exc}") from exc


def open_gguf(path: Path, hf_overrides: dict[str, Any] | None,
              reader: GGUFFile | None = None) -> tuple[GGUFFile, dict[str, Any], ModelArch]:
    """The file's header (``reader``: read already), metadata and decoder architecture."""
    reader = reader or read_header(path)
    meta = reader.meta
    names = {t.name for t in reader.tensors}
    config = _hf_config_from_gguf(meta, names)
    _longrope(reader, config)
    config = apply_overrides(config, hf_overrides)
    arch = arch_from_hf_config(config)
    if "rope_freqs.weight" in names:
        freqs = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
        factors = tuple(float(x) for x in freqs.data.view(np.float32))
        arch = dataclasses.replace(arch, rope=RopeConfig(theta=arch.rope.theta, freq_factors=factors))
    return reader, meta, arch
