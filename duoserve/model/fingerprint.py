"""Model fingerprints: engines that exchange KV must compute the same function.

sha256 over the architecture and every value that shapes the KV cache or the logits,
a digest of the tokenizer's vocabulary, a digest of the checkpoint's bytes and how its
weights are quantized (``--quantization``, ``--gguf-mode``). Dtype
and block size are left out: those are converted, not refused. Hashing the checkpoint
takes a moment, so its digest is cached under ~/.cache/duoserve keyed by path, size
and modification time.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import time
from pathlib import Path

from duoserve.model.arch import ModelArch
from duoserve.model.paths import cache_dir as duoserve_cache_dir
from duoserve.model.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

_SHAPE_FIELDS = ("architecture", "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                 "num_kv_heads", "head_dim", "rms_norm_eps", "tie_word_embeddings", "qkv_bias", "qk_norm",
                 "hidden_act", "attention_scale", "sliding_window", "layer_windows", "attn_logit_softcap",
                 "final_logit_softcap", "moe_layers", "num_experts", "experts_per_token", "moe_intermediate_size",
                 "shared_expert_intermediate_size", "norm_topk_prob")


def _checkpoint_files(path: Path) -> list[Path]:
    return [path] if path.is_file() else sorted(path.glob("*.safetensors"))


def weights_digest(path: Path) -> str:
    files = _checkpoint_files(path)
    key = json.dumps([[str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns] for f in files])
    cache_dir = duoserve_cache_dir("fingerprints")
    cache_file = cache_dir / hashlib.sha256(key.encode()).hexdigest()
    if cache_file.exists():
        return cache_file.read_text().strip()
    size = sum(f.stat().st_size for f in files)
    logger.info("computing the weight fingerprint of %s (%.0f MB, once: cached in %s)", path, size / 2**20, cache_dir)
    start = time.monotonic()
    digest = hashlib.sha256()
    for f in files:
        with open(f, "rb") as handle:
            while chunk := handle.read(1 << 22):
                digest.update(chunk)
    value = digest.hexdigest()
    logger.info("weight fingerprint computed in %.1fs", time.monotonic() - start)
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        cache_file.write_text(value)
    except OSError:
        pass  # a read-only cache only costs the hashing next time
    return value


def describe(arch: ModelArch, tokenizer: Tokenizer | None, path: Path, quantization: str = "none") -> dict:
    """The values the fingerprint covers, by name (engines show both sides' on a mismatch). The
    weight quantization is one: KV computed by a quantized model is not the dequantized model's,
    so a prefill and a decode engine must quantize alike."""
    values = {name: getattr(arch, name) for name in _SHAPE_FIELDS}
    values["rope"] = dataclasses.asdict(arch.rope)
    values["local_rope"] = dataclasses.asdict(arch.local_rope) if arch.local_rope else None
    values["tokenizer"] = tokenizer.vocabulary_digest() if tokenizer is not None else None
    values["weights"] = weights_digest(path)
    values["quantization"] = quantization
    return values


def fingerprint(values: dict) -> bytes:
    return hashlib.sha256(json.dumps(values, sort_keys=True, default=str).encode()).digest()


def describe_difference(a_name: str, a: dict, b_name: str, b: dict) -> str | None:
    """None when two engines' fingerprint values agree, else each differing value of both sides."""
    differ = [key for key in sorted(set(a) | set(b)) if a.get(key) != b.get(key)]
    if not differ:
        return None
    return "; ".join(f"{key}: {a_name}={a.get(key)!r}, {b_name}={b.get(key)!r}" for key in differ)
