"""Find a model (path, alias or the packaged default) and load it with its tokenizer."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from duoserve.config import ModelConfig
from duoserve.errors import ConfigError
from duoserve.model.arch import ModelArch
from duoserve.model.llama import LlamaModel
from duoserve.model.paths import default_model_path, resolve_model_path  # noqa: F401 (re-exported)
from duoserve.model.tokenizer import Tokenizer, tokenizer_from_gguf, tokenizer_from_hf_dir
from duoserve.model.weights import build_model

logger = logging.getLogger(__name__)

@dataclass
class LoadedModel:
    model: LlamaModel
    arch: ModelArch
    tokenizer: Tokenizer | None
    path: Path
    dtype: torch.dtype


def check_max_model_len(arch: ModelArch, max_model_len: int | None) -> int:
    """The context length to serve: ``max_model_len`` if the model allows it, else its own maximum."""
    if max_model_len is None:
        max_model_len = arch.max_position_embeddings
    elif max_model_len > arch.max_position_embeddings:
        raise ConfigError(
            "max_model_len", max_model_len,
            f"at most the model's max_position_embeddings ({arch.max_position_embeddings}), the context "
            "it was trained for",
            "Lower --max-model-len, or leave it unset to serve the model's whole context",
        )
    arch.check_max_model_len(max_model_len)
    return max_model_len


def load_model(config: ModelConfig) -> LoadedModel:
    path = resolve_model_path(config.model)
    dtype = getattr(torch, config.torch_dtype_name)
    if path.is_file():
        from duoserve.model.gguf_loader import GGUFSource, open_gguf

        reader, meta, arch = open_gguf(path, config.hf_overrides)
        tokenizer = tokenizer_from_gguf(meta, arch.eos_token_ids) if "tokenizer.ggml.tokens" in meta else None
        source = GGUFSource(reader, arch, permuted_qk=meta.get("general.architecture") == "llama")
    else:
        from duoserve.model.hf_loader import SafetensorsSource, read_hf_arch

        arch = read_hf_arch(path, config.hf_overrides)
        tokenizer = tokenizer_from_hf_dir(path, arch.bos_token_id, arch.eos_token_ids)
        source = SafetensorsSource(path)
    if tokenizer is None:
        logger.warning("%s has no tokenizer: only token-id prompts will work", path)
    max_model_len = check_max_model_len(arch, config.max_model_len)
    model = build_model(arch, source, dtype, config.resolved_device(), max_positions=max_model_len)
    return LoadedModel(model=model, arch=arch, tokenizer=tokenizer, path=path, dtype=dtype)
