"""Load a Hugging Face checkpoint directory: config.json, one or many *.safetensors, tokenizer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from duoserve.errors import ConfigError, ModelLoadError
from duoserve.model.arch import ModelArch, apply_overrides, arch_from_hf_config


def read_hf_arch(path: Path, hf_overrides: dict[str, Any] | None) -> ModelArch:
    config_file = path / "config.json"
    if not config_file.exists():
        raise ConfigError("model", str(path), "a directory holding config.json and *.safetensors, or a .gguf file")
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{config_file} is not valid JSON: {exc}") from exc
    return arch_from_hf_config(apply_overrides(config, hf_overrides))


class SafetensorsSource:
    """Look up tensors by name across every *.safetensors shard of a directory."""

    def __init__(self, path: Path) -> None:
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise ModelLoadError(f"no *.safetensors files in {path}")
        self._handles = [safe_open(str(f), framework="pt") for f in files]
        self._where = {name: h for h in self._handles for name in h.keys()}

    def __call__(self, name: str) -> torch.Tensor | None:
        handle = self._where.get(name)
        return None if handle is None else handle.get_tensor(name)
