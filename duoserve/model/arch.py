"""The hyper-parameters of a decoder (the Llama family with Phi-3, Gemma 2 and 3, mixtures of experts),
whatever file they came from.

Both loaders (a Hugging Face directory and a GGUF file) turn their metadata into
one ``ModelArch``; the model is built from it alone (``family`` picks the model's file).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from duoserve.errors import ConfigError
from duoserve.model.rope_params import RopeConfig, check_rope, rope_from_hf  # noqa: F401 (RopeConfig: re-exported)
from duoserve.model.rope_params import for_context as rope_for_context

# architecture name -> (has qkv bias by default, has q/k RMSNorm)
SUPPORTED_ARCHITECTURES: dict[str, tuple[bool, bool]] = {
    "LlamaForCausalLM": (False, False),
    "MistralForCausalLM": (False, False),
    "Qwen2ForCausalLM": (True, False),
    "Qwen3ForCausalLM": (False, True),
    "Gemma2ForCausalLM": (False, False),
    "Gemma3ForCausalLM": (False, True),
    "MixtralForCausalLM": (False, False),
    "Qwen2MoeForCausalLM": (True, False),
    "Qwen3MoeForCausalLM": (False, True),
    "Phi3ForCausalLM": (False, False),
}
# architectures whose checkpoints store Q/K/V and gate/up fused (qkv_proj, gate_up_proj), as our layers do
FUSED_CHECKPOINTS = frozenset({"Phi3ForCausalLM"})

# config.json's activation names -> ours (the MLP's gate activation)
_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


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
    hidden_act: str = "silu"                       # silu or gelu_tanh, times the up projection
    attention_scale: float | None = None           # None: head_dim ** -0.5
    # per layer, its sliding window or None (full attention); () means sliding_window for every layer
    layer_windows: tuple[int | None, ...] = ()
    local_rope: RopeConfig | None = None           # the rope of the windowed layers, where theirs differs
    attn_logit_softcap: float | None = None        # scores -> cap * tanh(scores / cap) before the softmax
    final_logit_softcap: float | None = None       # the same on the logits (Gemma 2)
    # a mixture of experts: per layer whether its MLP is routed (() for a dense model), each token's
    # top experts_per_token of num_experts, their weights renormalized to sum to 1 where norm_topk_prob,
    # plus (Qwen2-MoE) a shared expert behind a sigmoid gate
    moe_layers: tuple[bool, ...] = ()
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True

    @property
    def family(self) -> str:
        """Which model file builds this decoder: ``gemma`` (Gemma 2, 3), ``moe`` (Mixtral, Qwen MoE) or
        ``llama`` (Llama, Mistral, Qwen, Phi-3)."""
        if self.architecture.startswith("Gemma"):
            return "gemma"
        return "moe" if self.num_experts else "llama"

    def routed(self, layer: int) -> bool:
        """Whether ``layer``'s MLP is a mixture of experts."""
        return bool(self.moe_layers) and self.moe_layers[layer]

    def window(self, layer: int) -> int | None:
        """The sliding window of ``layer`` in tokens, or None where it attends over the whole context."""
        return self.layer_windows[layer] if self.layer_windows else self.sliding_window

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(
                "architecture", self.architecture,
                f"supported architectures are {', '.join(SUPPORTED_ARCHITECTURES)}",
            )
        for rope in (self.rope, self.local_rope):
            if rope is not None:
                check_rope(rope, self.head_dim)
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ConfigError(name, getattr(self, name), "a positive integer")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError("num_key_value_heads", self.num_kv_heads,
                              f"a divisor of num_attention_heads ({self.num_heads})")
        if self.hidden_act not in _ACTIVATIONS.values():
            raise ConfigError("hidden_act", self.hidden_act, f"one of {', '.join(sorted(_ACTIVATIONS))}")
        if self.layer_windows and len(self.layer_windows) != self.num_layers:
            raise ConfigError("layer_types", len(self.layer_windows),
                              f"one entry per layer ({self.num_layers})")
        if self.moe_layers:
            if len(self.moe_layers) != self.num_layers:
                raise ConfigError("mlp_only_layers", len(self.moe_layers), f"one entry per layer ({self.num_layers})")
            if not 1 <= self.experts_per_token <= self.num_experts:
                raise ConfigError("num_experts_per_tok", self.experts_per_token,
                                  f"between 1 and the number of experts ({self.num_experts})")
            if self.moe_intermediate_size <= 0:
                raise ConfigError("moe_intermediate_size", self.moe_intermediate_size, "a positive integer")
        for window in {self.sliding_window, *self.layer_windows} - {None}:
            if window <= 0:
                raise ConfigError("sliding_window", window, "a positive integer, or null for full attention")

    def for_context(self, max_model_len: int) -> ModelArch:
        """This decoder as served with ``max_model_len`` tokens of context: longrope picks its factors
        by it (the fingerprint then covers the choice), and a window no shorter than it is no window
        (it hides no key; Phi-3.5's 262,144 tokens would only keep the C++ decode step away)."""
        def binding(window: int | None) -> int | None:
            return window if window is not None and window < max_model_len else None

        local = rope_for_context(self.local_rope, max_model_len) if self.local_rope else None
        return replace(self, rope=rope_for_context(self.rope, max_model_len), local_rope=local,
                       sliding_window=binding(self.sliding_window),
                       layer_windows=tuple(binding(w) for w in self.layer_windows))

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def apply_overrides(config: dict[str, Any], overrides: dict[str, Any] | None) -> dict[str, Any]:
    """``hf_overrides``: mend a checkpoint's config.json values before they are read."""
    if not overrides:
        return config
    if not isinstance(overrides, dict):
        raise ConfigError("hf_overrides", overrides, "a JSON object of config.json keys to values")
    merged = dict(config)
    merged.update(overrides)
    return merged


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def arch_from_hf_config(config: dict[str, Any]) -> ModelArch:
    """Read a Hugging Face ``config.json`` (already merged with ``hf_overrides``)."""
    architecture, activation = _checked_architecture(config)
    default_bias, qk_norm = SUPPORTED_ARCHITECTURES[architecture]
    num_heads = int(config["num_attention_heads"])
    hidden = int(config["hidden_size"])
    sliding = config.get("sliding_window")
    if architecture.startswith("Qwen") and not config.get("use_sliding_window", False):
        sliding = None
    gemma = architecture.startswith("Gemma")
    gemma3 = architecture.startswith("Gemma3")
    num_layers = int(config["num_hidden_layers"])
    layer_windows = _layer_windows(config, sliding, num_layers, gemma, gemma3)
    scalar = config.get("query_pre_attn_scalar")
    return ModelArch(**_experts_from_hf(config, architecture, num_layers),
        architecture=architecture,
        vocab_size=int(config["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(config["intermediate_size"]),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
        head_dim=int(config.get("head_dim") or hidden // num_heads),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope=rope_from_hf(config),
        max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", gemma)),
        qkv_bias=bool(config.get("attention_bias", default_bias)),
        qk_norm=qk_norm,
        sliding_window=int(sliding) if sliding else None,
        bos_token_id=config.get("bos_token_id"),
        eos_token_ids=_eos_ids(config.get("eos_token_id")),
        hidden_act=_ACTIVATIONS[activation],
        attention_scale=float(scalar) ** -0.5 if gemma and scalar else None,
        layer_windows=layer_windows,
        local_rope=rope_from_hf(config, "sliding_attention") if gemma3 else None,
        attn_logit_softcap=_cap(config.get("attn_logit_softcapping")) if gemma else None,
        final_logit_softcap=_cap(config.get("final_logit_softcapping")) if gemma else None,
    )


def _checked_architecture(config: dict[str, Any]) -> tuple[str, str]:
    """The config's architecture and activation, refused by name where duoserve serves neither (or
    a field it would ignore is set)."""
    names = config.get("architectures") or []
    if not names:
        raise ConfigError("architectures", names,
                          f"one of {', '.join(SUPPORTED_ARCHITECTURES)} in config.json")
    architecture = names[0]
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ConfigError("architecture", architecture,
                          f"supported architectures are {', '.join(SUPPORTED_ARCHITECTURES)}")
    if not architecture.startswith("Gemma"):
        for field in ("final_logit_softcapping", "attn_logit_softcapping"):
            if config.get(field) is not None:
                raise ConfigError(field, config[field], f"null: {architecture} has no logit soft-capping")
    if config.get("use_bidirectional_attention"):
        raise ConfigError("use_bidirectional_attention", True, "false: duoserve serves causal decoders")
    activation = config.get("hidden_activation") or config.get("hidden_act") or "silu"
    if activation not in _ACTIVATIONS:
        raise ConfigError("hidden_act", activation, f"one of {', '.join(sorted(_ACTIVATIONS))}")
    return architecture, activation


def _layer_windows(config: dict[str, Any], sliding, num_layers: int, gemma: bool, gemma3: bool
                   ) -> tuple[int | None, ...]:
    """Each layer's sliding window (None: global) where layers differ; () where they all share one."""
    if not (sliding and (config.get("layer_types") or gemma)):
        return ()
    pattern = int(config.get("sliding_window_pattern") or config.get("_sliding_window_pattern")
                  or (6 if gemma3 else 2))  # Gemma 3: five local layers to one global; Gemma 2: alternate
    types = config.get("layer_types") or [
        "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
    return tuple(int(sliding) if t == "sliding_attention" else None for t in types)


def _experts_from_hf(config: dict[str, Any], architecture: str, num_layers: int) -> dict[str, Any]:
    """The mixture-of-experts fields of a Mixtral or Qwen MoE config (none for a dense one)."""
    if architecture not in ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
        return {}
    experts = int(config.get("num_local_experts") or config.get("num_experts") or 0)
    if experts <= 0:
        raise ConfigError("num_experts", experts, f"a positive integer: {architecture} is a mixture of experts")
    if architecture == "MixtralForCausalLM":   # every layer routed, top-k renormalized, no shared expert
        return dict(moe_layers=(True,) * num_layers, num_experts=experts,
                    experts_per_token=int(config.get("num_experts_per_tok", 2)),
                    moe_intermediate_size=int(config["intermediate_size"]), norm_topk_prob=True)
    dense = set(config.get("mlp_only_layers") or [])
    step = config.get("decoder_sparse_step")
    step = 1 if step is None else int(step)
    if step <= 0:
        raise ConfigError("decoder_sparse_step", step, "a positive integer")
    return dict(moe_layers=tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers)),
                num_experts=experts, experts_per_token=int(config.get("num_experts_per_tok", 1)),
                moe_intermediate_size=int(config.get("moe_intermediate_size") or config["intermediate_size"]),
                shared_expert_intermediate_size=int(config.get("shared_expert_intermediate_size") or 0),
                norm_topk_prob=bool(config.get("norm_topk_prob", False)))


def _cap(value: Any) -> float | None:
    if value is None:
        return None
    if not isinstance(value, (int, float)) or value <= 0:
        raise ConfigError("logit_softcapping", value, "a positive number, or null")
    return float(value)

