"""LoRA adapters as users have them: PEFT folders and llama.cpp's GGUF adapter files, read onto
our layers.

An adapter adds ``scale * B @ A`` to some of a model's projections. Ours are fused (``qkv`` holds
q, k and v's rows; ``gate_up`` gate's then up's), so each of the adapter's modules lands on a
slice of one of our layers' outputs: ``q_proj``'s update is the first ``q_size`` rows of
``layers.i.qkv``. ``LoRAAdapter.modules`` is, per our layer, every slice's A stacked (one matmul
of the input for them all) and each slice's B, its output rows and scale.

PEFT: ``adapter_config.json`` (``r``, ``lora_alpha``, ``use_rslora``: alpha / sqrt(r) instead of
alpha / r) and ``adapter_model.safetensors`` (``base_model.model.<HF module>.lora_A.weight``
[r, in] and ``lora_B.weight`` [out, r]). GGUF (llama.cpp's ``convert_lora_to_gguf.py``):
``general.type = adapter``, ``adapter.type = lora``, ``adapter.lora.alpha``, tensors
``blk.N.<name>.weight.lora_a`` / ``.lora_b`` in torch's order once read, Q and K's B rows permuted
as the base's are in a llama file. What an adapter asks that we cannot compute exactly (DoRA, a
bias, extra trained modules, per-module ranks, a rank past ``--max-lora-rank``, a module the base
lacks or of another shape) is refused by name (``LoRALoadError``): never served approximately.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from duoserve.errors import DuoserveError
from duoserve.model.arch import ModelArch
from duoserve.model.weights import checkpoint_parts

PEFT_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<which>[AB])(?:\.default)?\.weight$")
GGUF_KEY = re.compile(r"^(?P<tensor>.+\.weight)\.lora_(?P<which>[ab])$")
# PEFT settings whose answer we could not give exactly: refused unless they ask for nothing
UNSUPPORTED = {"use_dora": (False, None), "bias": ("none", None), "modules_to_save": (None, []),
               "fan_in_fan_out": (False, None), "rank_pattern": ({}, None), "alpha_pattern": ({}, None),
               "layer_replication": (None, []), "megatron_config": (None, {})}


class LoRALoadError(DuoserveError):
    """An adapter that cannot be served on this model, and why (the server answers 400 with it)."""


@dataclass
class LoRASlice:
    offset: int            # the slice's first output row in our layer
    rows: int
    ranks: tuple[int, int]   # its rows in the layer's stacked A
    b: torch.Tensor        # [rows, r]
    scale: float


@dataclass
class LoRALayer:
    a: torch.Tensor                       # every slice's A, stacked: [sum of ranks, in]
    slices: list[LoRASlice] = field(default_factory=list)


@dataclass
class LoRAAdapter:
    name: str
    path: str
    rank: int
    digest: str                           # of the adapter's files: its identity in every KV key
    modules: dict[str, LoRALayer]         # our layer ("layers.3.qkv") -> its update

    def nbytes(self) -> int:
        return sum(m.a.nbytes + sum(s.b.nbytes for s in m.slices) for m in self.modules.values())


def adapter_targets(arch: ModelArch) -> dict[str, tuple[str, int, int, int]]:
    """HF weight name ("model.layers.0.self_attn.q_proj.weight") -> (our layer, first output row,
    rows, input width), for every projection an adapter may target."""
    targets = {}
    for ours, parts in checkpoint_parts(arch).items():
        layer = ours[:-len(".weight")]
        if not ours.endswith(".weight") or layer.rsplit(".", 1)[-1] not in ("qkv", "o_proj", "gate_up", "down") or (
                ".moe." in ours):
            continue
        offset = 0
        for hf_name, (rows, cols) in parts:
            targets[hf_name] = (layer, offset, rows, cols)
            offset += rows
    return targets


def load_adapter(name: str, path: str, arch: ModelArch, max_rank: int, dtype: torch.dtype,
                 gguf_arch: str | None = None) -> LoRAAdapter:
    """The adapter at ``path`` (a PEFT folder or a GGUF file) on a model of ``arch``, in ``dtype``."""
    source = Path(path)
    if source.is_dir():
        pairs, alpha, rslora, files = _peft(source)
    elif source.is_file():
        pairs, alpha, rslora, files = _gguf(source, arch, gguf_arch)
    else:
        raise LoRALoadError(f"adapter {name!r}: no PEFT folder or GGUF file at {path}")
    digest = hashlib.sha256(b"".join(hashlib.sha256(f.read_bytes()).digest() for f in files)).hexdigest()
    return _assemble(name, path, pairs, alpha, rslora, arch, max_rank, dtype, digest)


def _peft(folder: Path) -> tuple[dict, float, bool, list[Path]]:
    config_file, weights_file = folder / "adapter_config.json", folder / "adapter_model.safetensors"
    if not config_file.exists():
        raise LoRALoadError(f"{folder} has no adapter_config.json: not a PEFT adapter folder")
    if not weights_file.exists():
        raise LoRALoadError(f"{folder} has no adapter_model.safetensors (a .bin adapter: save it with "
                            "safe_serialization=True)")
    config = json.loads(config_file.read_text())
    if config.get("peft_type", "LORA") != "LORA":
        raise LoRALoadError(f"{folder}: peft_type {config.get('peft_type')!r} is not LoRA")
    for key, allowed in UNSUPPORTED.items():
        if key in config and config[key] not in allowed:
            raise LoRALoadError(f"{folder}: adapter_config.json's {key}={config[key]!r} is not supported "
                                f"(only {allowed[0]!r})")
    from safetensors.torch import load_file

    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in load_file(str(weights_file)).items():
        match = PEFT_KEY.match(key)
        if match is None:
            raise LoRALoadError(f"{folder}: tensor {key!r} is no LoRA A or B weight")
        pairs.setdefault(match["module"] + ".weight", {})[match["which"]] = tensor
    return pairs, float(config.get("lora_alpha", config.get("r", 8))), bool(config.get("use_rslora")), [
        config_file, weights_file]


def _gguf(file: Path, arch: ModelArch, gguf_arch: str | None) -> tuple[dict, float, bool, list[Path]]:
    from duoserve.model.dequant import dequantize
    from duoserve.model.gguf_file import read_gguf
    from duoserve.model.gguf_loader import _unpermute, hf_names

    try:
        reader = read_gguf(file)
    except ValueError as exc:
        raise LoRALoadError(f"{file}: not a GGUF adapter ({exc})") from None
    meta = reader.meta
    if meta.get("general.type") != "adapter" or meta.get("adapter.type") != "lora":
        raise LoRALoadError(f"{file}: general.type={meta.get('general.type')!r}, adapter.type="
                            f"{meta.get('adapter.type')!r}: not a LoRA adapter file")
    file_arch = meta.get("general.architecture")
    if gguf_arch is not None and file_arch != gguf_arch:
        raise LoRALoadError(f"{file}: an adapter for {file_arch!r} models, not this {gguf_arch!r} model")
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for tensor in reader.tensors:
        match = GGUF_KEY.match(tensor.name)
        names = hf_names(match["tensor"], file_arch or "llama") if match else []
        if len(names) != 1 or names[0][1] is not None:
            raise LoRALoadError(f"{file}: tensor {tensor.name!r} is no LoRA A or B weight of a projection")
        shape = tuple(int(d) for d in reversed(tensor.shape))
        values = dequantize(tensor.data, tensor.tensor_type.name, shape, tensor.name).float()
        hf_name, which = names[0][0], match["which"].upper()
        if which == "B" and file_arch == "llama" and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            values = _unpermute(values, arch.num_heads if "q_proj" in hf_name else arch.num_kv_heads)
        pairs.setdefault(hf_name, {})[which] = values
    return pairs, float(meta.get("adapter.lora.alpha", 0.0)), False, [file]


def _assemble(name: str, path: str, pairs: dict, alpha: float, rslora: bool, arch: ModelArch, max_rank: int,
              dtype: torch.dtype, digest: str) -> LoRAAdapter:
    targets = adapter_targets(arch)
    layers: dict[str, list[tuple[int, int, torch.Tensor, torch.Tensor]]] = {}
    rank = 0
    for hf_name, pair in sorted(pairs.items()):
        if set(pair) != {"A", "B"}:
            raise LoRALoadError(f"adapter {name!r}: {hf_name} has lora_{next(iter(pair))} without its pair")
        if hf_name not in targets:
            raise LoRALoadError(f"adapter {name!r} targets {hf_name[:-len('.weight')]}, which this model's "
                                "projections do not include (q/k/v/o and the MLP's gate/up/down)")
        layer, offset, rows, cols = targets[hf_name]
        a, b = pair["A"], pair["B"]
        r = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != cols or b.shape != (rows, r):
            raise LoRALoadError(f"adapter {name!r}: {hf_name}'s A {list(a.shape)} and B {list(b.shape)} do not fit "
                                f"this model's [{rows}, {cols}] projection: an adapter of another base model")
        if r > max_rank:
            raise LoRALoadError(f"adapter {name!r} has rank {r}, over --max-lora-rank {max_rank}")
        rank = max(rank, r)
        layers.setdefault(layer, []).append((offset, rows, a, b))
    if not layers:
        raise LoRALoadError(f"adapter {name!r} holds no LoRA weights")
    modules = {}
    for layer, parts in layers.items():
        stacked, slices, first = [], [], 0
        for offset, rows, a, b in sorted(parts, key=lambda p: p[0]):
            r = a.shape[0]
            scale = alpha / (math.sqrt(r) if rslora else r)
            stacked.append(a.to(dtype))
            slices.append(LoRASlice(offset, rows, (first, first + r), b.to(dtype).contiguous(), scale))
            first += r
        modules[layer] = LoRALayer(torch.cat(stacked).contiguous(), slices)
    return LoRAAdapter(name, path, rank, digest, modules)
