"""The rotary embedding's parameters as read from a checkpoint's config, resolved and checked.

A config names its rope type and gives some of its parameters; what it leaves out (YaRN's attention
factor, longrope's factor, the ramp's ends) is filled in here with transformers' defaults, so that a
``RopeConfig`` holds every value that shapes the rotation, and two engines compare them (the
fingerprint) without knowing the rules. The tables themselves are ``rope.py``'s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from duoserve.errors import ConfigError

SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear", "yarn", "dynamic", "longrope")
_ALIASES = {"su": "longrope"}   # Phi-3's first configs named longrope "su"


@dataclass(frozen=True)
class RopeConfig:
    """Every value that shapes the rotation (all of them in the fingerprint)."""
    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0                   # llama3
    high_freq_factor: float = 4.0                  # llama3
    # the context the model was trained for: llama3, yarn, longrope's switch, dynamic's growth
    original_max_position_embeddings: int | None = None
    freq_factors: tuple[float, ...] | None = None  # GGUF rope_freqs: per-frequency divisors
    attention_factor: float = 1.0                  # yarn, longrope: cos and sin scaled by it
    beta_fast: float = 32.0                        # yarn: the ramp's ends, in rotations over the
    beta_slow: float = 1.0                         # original context
    truncate: bool = True                          # yarn: the ramp's ends rounded outwards
    short_factor: tuple[float, ...] | None = None  # longrope: frequency divisors for a context within
    long_factor: tuple[float, ...] | None = None   # the original one, and for a longer one
    long_context: bool = False                     # longrope: the long factors in use (for_context)

    def max_context(self, max_position_embeddings: int) -> int:
        """The longest context the scaling is meant for: the original context times the factor for
        yarn and dynamic NTK (vLLM's rule), max_position_embeddings otherwise."""
        if self.rope_type in ("yarn", "dynamic") and self.original_max_position_embeddings:
            return max(max_position_embeddings, int(self.original_max_position_embeddings * self.factor))
        return max_position_embeddings


def for_context(rope: RopeConfig, max_model_len: int) -> RopeConfig:
    """``rope`` as served with a context of ``max_model_len`` tokens: longrope takes its long factors
    at every position when that passes the original context, its short ones otherwise. (Per
    position, or per sequence length as transformers does, a token's KV would depend on how far
    its sequence has got; llama.cpp and vLLM decide by the context served, as here.)"""
    if rope.rope_type != "longrope":
        return rope
    return replace(rope, long_context=max_model_len > (rope.original_max_position_embeddings or 0))


def rope_from_hf(config: dict[str, Any], layer_type: str = "full_attention") -> RopeConfig:
    """The rope of a config.json's layers of ``layer_type``. transformers >= 5 writes
    rope_parameters (per layer type where those differ: Gemma 3); older checkpoints rope_theta +
    rope_scaling (+ rope_local_base_freq for Gemma 3's local layers, a top-level
    original_max_position_embeddings for Phi-3)."""
    params = dict(config.get("rope_parameters") or {})
    if layer_type in params and isinstance(params[layer_type], dict):
        params = dict(params[layer_type])
    elif layer_type == "sliding_attention":
        return RopeConfig(theta=float(config.get("rope_local_base_freq", 10000.0)))
    params = {**(config.get("rope_scaling") or {}), **params}
    rope_type = params.get("rope_type", params.get("type", "default"))
    rope_type = _ALIASES.get(rope_type, rope_type)
    if float(params.get("partial_rotary_factor", config.get("partial_rotary_factor")) or 1.0) != 1.0:
        raise ConfigError("partial_rotary_factor", params.get("partial_rotary_factor", config.get("partial_rotary_factor")),
                          "1.0: duoserve rotates whole heads")
    original = params.get("original_max_position_embeddings") or config.get("original_max_position_embeddings")
    max_positions = int(config.get("max_position_embeddings", 2048))
    base = dict(theta=float(params.get("rope_theta", config.get("rope_theta", 10000.0))), rope_type=rope_type,
                original_max_position_embeddings=int(original) if original else None)
    if rope_type == "yarn":
        return RopeConfig(**base, **_yarn_params(params, original, max_positions))
    if rope_type == "longrope":
        return RopeConfig(**base, **_longrope_params(params, original, max_positions))
    if rope_type == "dynamic":   # transformers grows the base past max_position_embeddings itself
        base["original_max_position_embeddings"] = max_positions
    return RopeConfig(**base, factor=float(params.get("factor", 1.0)),
                      low_freq_factor=float(params.get("low_freq_factor", 1.0)),
                      high_freq_factor=float(params.get("high_freq_factor", 4.0)))


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention factor for a context ``factor`` times the original one."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _factor(params: dict[str, Any], original: Any, max_positions: int, why: str) -> float:
    """The config's factor, else max_position_embeddings / the original context (which must be given)."""
    if not original:
        raise ConfigError("rope_scaling.original_max_position_embeddings", original, f"a positive integer: {why}")
    factor = params.get("factor")
    return float(factor) if factor is not None else max_positions / int(original)


def _yarn_params(params: dict[str, Any], original: Any, max_positions: int) -> dict[str, Any]:
    """factor, the attention factor (else from the factor and DeepSeek's mscale / mscale_all_dim),
    the ramp's ends (32 and 1 rotations)."""
    factor = _factor(params, original, max_positions, "YaRN scales from the context the model was trained for")
    attention = params.get("attention_factor")
    if attention is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        else:
            attention = yarn_mscale(factor)
    return dict(factor=factor, attention_factor=float(attention), beta_fast=float(params.get("beta_fast") or 32),
                beta_slow=float(params.get("beta_slow") or 1), truncate=bool(params.get("truncate", True)))


def _longrope_params(params: dict[str, Any], original: Any, max_positions: int) -> dict[str, Any]:
    """The short and long factors, the factor and the attention factor (else
    sqrt(1 + ln(factor) / ln(original)), 1 without scaling)."""
    factor = _factor(params, original, max_positions,
                     "longrope switches factors at the context the model was trained for")
    attention = params.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(int(original)))
    short, long = params.get("short_factor"), params.get("long_factor")
    return dict(factor=factor, attention_factor=float(attention),
                short_factor=tuple(float(f) for f in short) if short else None,
                long_factor=tuple(float(f) for f in long) if long else None)


def check_rope(rope: RopeConfig, head_dim: int) -> None:
    """A ConfigError naming the field when the rope cannot be computed."""
    if rope.rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError("rope_scaling.rope_type", rope.rope_type,
                          f"supported rope types are {', '.join(SUPPORTED_ROPE_TYPES)}")
    if rope.rope_type in ("yarn", "dynamic", "linear") and not rope.factor > 0:
        raise ConfigError("rope_scaling.factor", rope.factor, "a positive number")
    if rope.rope_type == "longrope":
        for name in ("short_factor", "long_factor"):
            factors = getattr(rope, name)
            if factors is None or len(factors) != head_dim // 2:
                raise ConfigError(f"rope_scaling.{name}", None if factors is None else len(factors),
                                  f"a list of head_dim / 2 ({head_dim // 2}) factors")
