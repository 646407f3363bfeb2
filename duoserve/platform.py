"""What this machine offers, asked at run time: the device a config's ``auto`` means, whether a
GPU it names exists, the dtype ``auto`` resolves to there, and the quantization of a model file.

``duoserve.config`` only validates values; the engine's builder (and ``serve --dry-run``'s plan)
resolve every ``auto`` here once, into one ``RunTime`` record handed to what loads and sizes the
model, on the process that runs it. The API process never imports this module, so it never
imports torch.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from duoserve.config import CacheConfig, ModelConfig
from duoserve.errors import ConfigError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunTime:
    """A model config's ``auto`` values as this machine resolves them (``resolve``)."""
    device: str          # cpu, cuda, cuda:N
    dtype: str           # the weights' and activations' torch dtype, by name
    kv_dtype: str        # the KV cache's
    quantization: str    # none, gguf or int8

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def torch_kv_dtype(self) -> torch.dtype:
        return getattr(torch, self.kv_dtype)


def resolve(model: ModelConfig, path: Path, cache: CacheConfig | None = None, dtype: str | None = None) -> RunTime:
    """Every ``auto`` of ``model`` (its file at ``path``) and ``cache`` for this machine, once;
    ``dtype``: the weights' where they are loaded already."""
    device = resolve_device(model)
    dtype = dtype or resolve_dtype(model)
    kv_dtype = dtype if cache is None or cache.kv_cache_dtype == "auto" else cache.kv_cache_dtype
    return RunTime(device, dtype, kv_dtype, resolve_quantization(model, path, device))


def cpu_has_native_bf16() -> bool:
    """The CPU multiplies bf16 natively (AVX512-BF16 or AMX-BF16), read from /proc/cpuinfo."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_device(model: ModelConfig) -> str:
    """The device to run on; ``auto`` asks torch whether a GPU is visible, ``cuda`` that one is."""
    if model.device == "cpu":
        return "cpu"
    if model.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if not torch.cuda.is_available():
        build = "built without CUDA" if torch.version.cuda is None else f"CUDA {torch.version.cuda}"
        raise ConfigError("device", model.device, f"cpu or auto: no CUDA device is visible (torch "
                                                  f"{torch.__version__}, {build})")
    index = int(model.device.partition(":")[2] or 0)
    if index >= torch.cuda.device_count():
        raise ConfigError("device", model.device, f"cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    return model.device


def resolve_dtype(model: ModelConfig) -> str:
    """The torch dtype name of the weights. ``auto``: bfloat16 on a GPU, and on a CPU whose vector
    units compute in bf16 (AVX512-BF16 or AMX, where it is faster than float32 per step:
    BENCHMARKS.md); float32 elsewhere."""
    if model.dtype != "auto":
        return model.dtype
    if resolve_device(model) != "cpu":
        return "bfloat16"
    return "bfloat16" if cpu_has_native_bf16() else "float32"


def resolve_quantization(config: ModelConfig, path: Path, device: str) -> str:
    """``none``, ``gguf`` or ``int8`` for this model file and device (``auto`` decided here), given
    whether the kernels that compute from GGUF blocks run here."""
    wanted = config.quantization
    if wanted == "gguf" and not path.is_file():
        raise ConfigError("quantization", wanted, "none or int8 for a Hugging Face checkpoint directory "
                          "(gguf computes from the blocks of a .gguf file)")
    if wanted in ("gguf", "int8") and device != "cpu":
        raise ConfigError("quantization", wanted, f"none on {device} (quantized kernels run on the CPU)")
    if wanted == "auto":
        wanted = "gguf" if path.is_file() and device == "cpu" else "none"
    if wanted == "gguf":
        from duoserve.kernels.gguf import gguf_kernels

        if gguf_kernels() is None:
            logger.warning("GGUF blocks need the C kernels (no C compiler, or DUOSERVE_C_KERNELS=0): "
                           "dequantizing the weights at load (--quantization none)")
            return "none"
    return wanted


def available_bytes() -> int | None:
    """The memory the kernel says can be had now without swapping (Linux's MemAvailable), else None."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return None
