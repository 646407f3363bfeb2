"""One validated configuration tree.

Every value is checked when its dataclass is built; a ``ConfigError`` names the
field, the value and what is allowed. The tree is frozen: values found at run time
(number of KV blocks, eos ids) live in separate objects.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from duoserve.errors import ConfigError

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEFAULT_MODEL_ALIAS = "smollm2-135m"


def parse_device(value: str) -> str:
    """``cpu``, ``cuda`` or ``cuda:N``."""
    if value in ("cpu", "cuda"):
        return value
    if value.startswith("cuda:") and value[5:].isdigit():
        return value
    raise ConfigError("device", value, "one of cpu, cuda, cuda:N")


@dataclass(frozen=True)
class ModelConfig:
    model: str | None = None          # HF directory, .gguf file, alias, or None for the default model
    dtype: str = "auto"               # auto = float32 on CPU, bfloat16 on GPU
    device: str = "cpu"
    hf_overrides: dict[str, Any] = field(default_factory=dict)
    max_model_len: int | None = None  # None = the model's max_position_embeddings
    seed: int = 0

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ConfigError("dtype", self.dtype, f"one of {', '.join(DTYPES)}")
        parse_device(self.device)
        if not isinstance(self.hf_overrides, dict):
            raise ConfigError("hf_overrides", self.hf_overrides,
                              'a JSON object of config.json keys, e.g. {"max_position_embeddings": 32768}')
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ConfigError("max_model_len", self.max_model_len, "a positive number of tokens")

    @property
    def torch_dtype_name(self) -> str:
        if self.dtype != "auto":
            return self.dtype
        return "float32" if self.device == "cpu" else "bfloat16"
