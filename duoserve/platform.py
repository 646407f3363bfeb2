"""What this machine offers, asked at run time: the device a config's ``auto`` means, whether a
GPU it names exists, and the dtype ``auto`` resolves to there.

``duoserve.config`` only validates values; the engine (and ``serve --dry-run``) resolve them here
once, on the process that runs the model. The API process never imports this module, so it
never imports torch.
"""

from __future__ import annotations

from pathlib import Path

import torch

from duoserve.config import ModelConfig
from duoserve.errors import ConfigError


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


def available_bytes() -> int | None:
    """The memory the kernel says can be had now without swapping (Linux's MemAvailable), else None."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return None
