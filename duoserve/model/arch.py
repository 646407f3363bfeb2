"""The hyper-parameters of a Llama-family decoder, whatever file they came from.

Both loaders (a Hugging Face directory and a GGUF file) turn their metadata into
one ``ModelArch``; the model is built from it alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from duoserve.errors import ConfigError

# architecture name -> (has qkv bias by default, has q/k RMSNorm)
SUPPORTED_ARCHITECTURES: dict[str, tuple[bool, bool]] = {
    "LlamaForCausalLM": (False, False),
    "MistralForCausalLM": (False, False),
    "Qwen2ForCausalLM": (True, False),
    "Qwen3ForCausalLM": (False, True),
}

SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear")


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
    freq_factors: tuple[float, ...] | None = None  # GGUF rope_freqs: per-frequency divisors


@dataclass(frozen=True)
class ModelArch:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(
                "architecture", self.architecture,
                f"supported architectures are {', '.join(SUPPORTED_ARCHITECTURES)}",
            )
        if self.rope.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ConfigError("rope_scaling.rope_type", self.rope.rope_type,
                              f"supported rope types are {', '.join(SUPPORTED_ROPE_TYPES)}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ConfigError(name, getattr(self, name), "a positive integer")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError("num_key_value_heads", self.num_kv_heads,
                              f"a divisor of num_attention_heads ({self.num_heads})")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def check_max_model_len(self, max_model_len: int) -> None:
        """Refuse a context the checkpoint cannot attend over exactly."""
        if self.sliding_window is not None and self.sliding_window < max_model_len:
            raise ConfigError(
                "max_model_len", max_model_len,
                f"at most the model's sliding_window ({self.sliding_window}): sliding-window "
                "attention is not implemented, so longer contexts would be computed wrongly",
                "Lower --max-model-len, or use a checkpoint without a sliding window",
            )


def apply_overrides(config: dict[str, Any], overrides: dict[str, Any] | None) -> dict[str, Any]:
    """``hf_overrides``: mend a checkpoint's config.json values before they are read."""
    if not overrides:
        return config
    if not isinstance(overrides, dict):
        raise ConfigError("hf_overrides", overrides, "a JSON object of config.json keys to values")
    merged = dict(config)
    merged.update(overrides)
    return merged


def _rope_from_hf(config: dict[str, Any]) -> RopeConfig:
    # transformers >= 5 writes rope_parameters; older checkpoints rope_theta + rope_scaling.
    params = dict(config.get("rope_parameters") or {})
    scaling = config.get("rope_scaling") or {}
    params = {**scaling, **params}
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    return RopeConfig(
        theta=theta,
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=params.get("original_max_position_embeddings"),
    )


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def arch_from_hf_config(config: dict[str, Any]) -> ModelArch:
    """Read a Hugging Face ``config.json`` (already merged with ``hf_overrides``)."""
    names = config.get("architectures") or []
    if not names:
        raise ConfigError("architectures", names,
                          f"one of {', '.join(SUPPORTED_ARCHITECTURES)} in config.json")
    architecture = names[0]
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ConfigError("architecture", architecture,
                          f"supported architectures are {', '.join(SUPPORTED_ARCHITECTURES)}")
    default_bias, qk_norm = SUPPORTED_ARCHITECTURES[architecture]
    num_heads = int(config["num_attention_heads"])
    hidden = int(config["hidden_size"])
    sliding = config.get("sliding_window")
    if architecture.startswith("Qwen") and not config.get("use_sliding_window", False):
        sliding = None
    return ModelArch(
        architecture=architecture,
        vocab_size=int(config["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(config["intermediate_size"]),
        num_layers=int(config["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
        head_dim=int(config.get("head_dim") or hidden // num_heads),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope=_rope_from_hf(config),
        max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        qkv_bias=bool(config.get("attention_bias", default_bias)),
        qk_norm=qk_norm,
        sliding_window=int(sliding) if sliding else None,
        bos_token_id=config.get("bos_token_id"),
        eos_token_ids=_eos_ids(config.get("eos_token_id")),
    )

