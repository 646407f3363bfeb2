"""Where an engine's memory goes: weights by kind, the KV pool and swap space (reserved and
resident), the temporary memory of the largest prefill chunk, the runtime around
them, and the process's resident size.

Resident sizes come from the kernel: ``/proc/self/status`` for the process and ``mincore`` for
the pages of one large buffer (the KV pool: written whole at start, resident whole unless the
kernel swaps pages out). The prefill scratch is estimated from the model's shapes; with
``DUOSERVE_MEASURE_SCRATCH=1`` it is measured instead, by resetting the process's peak
(``/proc/self/clear_refs``), running one forward of the step budget's tokens, and taking the
peak's rise above the resident size before it, less the KV pages that forward wrote.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import TYPE_CHECKING

from duoserve import envs
from duoserve.core.kv_cache_manager import NO_WINDOW, window_to_free
from duoserve.model.reranker import split_reranker

if TYPE_CHECKING:  # torch-free at import: the API process reads its own size with rss_bytes
    import torch


def _status_kb(field: str, pid: int | str = "self") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def rss_bytes(pid: int | str = "self") -> int:
    """The resident size of this process, or of process ``pid`` (0 once it is gone)."""
    try:
        return _status_kb("VmRSS", pid) * 1024
    except (FileNotFoundError, ProcessLookupError):
        return 0


def tensor_resident_bytes(tensor: "torch.Tensor") -> int:
    """Resident bytes of the pages that hold ``tensor``'s storage (``mincore``; 0 where it fails).
    Exactly its own pages: a mapping's size would count whatever the kernel merged into it."""
    import ctypes

    page = os.sysconf("SC_PAGE_SIZE")
    storage = tensor.untyped_storage()
    start = storage.data_ptr() // page * page
    end = storage.data_ptr() + storage.nbytes()
    pages = (end - start + page - 1) // page
    vector = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    if libc.mincore(start, pages * page, vector) != 0:
        return 0
    return sum(b & 1 for b in bytes(vector)) * page


def reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def measure_prefill_scratch(run_forward, kv_buffer: "torch.Tensor") -> int | None:
    """Peak temporary bytes of ``run_forward()`` (one prefill chunk), or None where the kernel
    does not let the peak be reset."""
    before, kv_before = rss_bytes(), tensor_resident_bytes(kv_buffer)
    if not reset_peak():
        return None
    run_forward()
    peak = _status_kb("VmHWM") * 1024
    return max(0, peak - before - (tensor_resident_bytes(kv_buffer) - kv_before))


SCRATCH_OVERHEAD = 2   # measured peaks run close to twice the activations' sum (BENCHMARKS.md, session 18)


def estimate_prefill_scratch(arch, num_tokens: int, element_size: int) -> int:
    """Temporary bytes of one prefill chunk of ``num_tokens``, from the model's shapes: a chunk's
    live activations (a few hidden-size rows, the MLP's intermediate rows, Q/K/V), times what
    the allocator and the kernels' own temporaries add on top of them."""
    return SCRATCH_OVERHEAD * num_tokens * element_size * (
        6 * arch.hidden_size + 3 * arch.intermediate_size + arch.head_dim * (arch.num_heads + 2 * arch.num_kv_heads))


def scratch_measured() -> bool:
    """``DUOSERVE_MEASURE_SCRATCH=1``: the engine runs one chunk of the step budget at start and
    reports its measured peak instead of the estimate (a forward costs start-up time; the
    memory report's own tests ask for it)."""
    return envs.DUOSERVE_MEASURE_SCRATCH


def _checkpoint_weights(path: Path, quantization: str, dtype_bytes: int) -> int:
    """Bytes the weights will take, from the checkpoint's tensor sizes (no weights are read)."""
    if path.is_file():
        from duoserve.model.gguf_file import read_gguf

        tensors = read_gguf(path).tensors
        if quantization == "gguf":
            return sum(int(t.n_bytes) for t in tensors)
        return sum(int(t.n_elements) for t in tensors) * dtype_bytes
    from safetensors import safe_open

    elements = 0
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            elements += sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())
    return elements * (1 if quantization == "int8" else dtype_bytes)


RUNTIME_ESTIMATE = 250 * 2**20   # python, torch and the libraries of an engine process, measured here


def plan(config) -> dict:
    """What an engine of ``config`` would allocate, without loading it: weights (from the
    checkpoint's tensor sizes), the KV pool (blocks, tokens, the batch it holds at full
    context), swap, an estimate of the prefill scratch, and the total against the memory
    available now. Raises ``ConfigError`` (naming the numbers) for a config that cannot fit."""
    import torch

    from duoserve.errors import ConfigError
    from duoserve.model.loader import check_max_model_len, resolve_model_path
    from duoserve.platform import available_bytes, resolve
    from duoserve.worker.kv_cache import bytes_per_token, plan_kv_pool

    path = resolve_model_path(config.model.model)
    runtime = resolve(config.model, path, config.cache)   # every "auto", as the engine's builder resolves it
    device = runtime.device
    overrides = split_reranker(config.model.hf_overrides)[0]   # a yes/no reranker plans as its causal LM
    encoder = _encoder_arch(path)
    if encoder is not None:
        return _encoder_plan(config, path, runtime, encoder)
    if path.is_file():
        from duoserve.model.gguf_loader import open_gguf

        arch = open_gguf(path, overrides)[2]
    else:
        from duoserve.model.hf_loader import read_hf_arch

        arch = read_hf_arch(path, overrides)
    dtype, kv_dtype, quantization = runtime.torch_dtype, runtime.torch_kv_dtype, runtime.quantization
    weights = _checkpoint_weights(path, quantization, torch.tensor([], dtype=dtype).element_size())
    # refuses a pool too small for an asked context; caps the model's own to what the pool holds
    pool = plan_kv_pool(arch, config.cache, kv_dtype, device, check_max_model_len(arch, config.model.max_model_len),
                        config.model.max_model_len is not None)
    blocks, max_model_len = pool.num_blocks, pool.max_model_len
    served = arch.for_context(max_model_len)   # a window no shorter than the context is none
    windows = window_to_free([served.window(i) for i in range(served.num_layers)], config.role,
                             config.speculative is not None and config.speculative.method == "draft")[1]
    per_token = bytes_per_token(arch, kv_dtype)
    block_bytes = per_token * config.cache.block_size
    budget = config.scheduler.token_budget(max_model_len)
    scratch = estimate_prefill_scratch(arch, budget, torch.tensor([], dtype=dtype).element_size())
    swap = int(config.cache.swap_space * 2**30) // block_bytes * block_bytes
    total = RUNTIME_ESTIMATE + weights + blocks * block_bytes + swap + scratch
    result = {
        "model": str(path), "quantization": quantization, "dtype": str(dtype).removeprefix("torch."),
        "weights_bytes": weights, "kv_pool": {"blocks": blocks, "tokens": blocks * config.cache.block_size,
                                              "bytes": blocks * block_bytes, "bytes_per_token": per_token,
                                              "dtype": str(kv_dtype).removeprefix("torch."), "sizing": pool.note,
                                              "window_freeing": windows},
        "max_model_len": max_model_len, "sequences_at_full_context": blocks * config.cache.block_size // max_model_len,
        "step_token_budget": budget, "swap_bytes": swap, "prefill_scratch_estimate_bytes": scratch,
        "runtime_estimate_bytes": RUNTIME_ESTIMATE, "total_bytes": total, "available_bytes": available_bytes(),
    }
    if device == "cpu" and result["available_bytes"] is not None and total > result["available_bytes"]:
        gib = 2 ** 30
        raise ConfigError("kv_cache_memory", config.cache.kv_cache_memory,
                          f"a plan that fits: weights {weights / gib:.2f} + KV {blocks * block_bytes / gib:.2f} + swap "
                          f"{swap / gib:.2f} + scratch {scratch / gib:.2f} + runtime {RUNTIME_ESTIMATE / gib:.2f} = "
                          f"{total / gib:.2f} GiB, but {result['available_bytes'] / gib:.2f} GiB is available",
                          "Lower --kv-cache-memory or --swap-space, or quantize the weights")
    return result


def _encoder_arch(path: Path):
    """A cross-encoder's architecture (``duoserve.model.encoder``), or None for a decoder."""
    import json

    if path.is_file():
        from duoserve.model.gguf_encoder import GGUF_ENCODER_ARCH, gguf_encoder_arch
        from duoserve.model.gguf_file import read_gguf

        reader = read_gguf(path)
        return gguf_encoder_arch(reader) if reader.meta.get("general.architecture") == GGUF_ENCODER_ARCH else None
    from duoserve.model.encoder import encoder_arch_from_hf, is_encoder_config

    config = json.loads((path / "config.json").read_text()) if (path / "config.json").exists() else {}
    return encoder_arch_from_hf(config, sep_token_id=0) if is_encoder_config(config) else None


def _encoder_plan(config, path: Path, runtime, arch) -> dict:
    """A cross-encoder's plan: its weights (dequantized) and one step's scratch; it keeps no KV."""
    import torch

    from duoserve.model.loader import check_max_model_len
    from duoserve.platform import available_bytes

    element = torch.tensor([], dtype=runtime.torch_dtype).element_size()
    weights = _checkpoint_weights(path, "none", element)
    max_model_len = check_max_model_len(arch, config.model.max_model_len)
    budget = config.scheduler.max_num_batched_tokens or max(max_model_len, 2048)
    scratch = SCRATCH_OVERHEAD * budget * (4 * arch.hidden_size + arch.intermediate_size) * element
    total = RUNTIME_ESTIMATE + weights + scratch
    return {"model": str(path), "quantization": "none", "dtype": str(runtime.torch_dtype).removeprefix("torch."),
            "weights_bytes": weights, "kv_pool": {"blocks": 0, "tokens": 0, "bytes": 0, "bytes_per_token": 0,
                                                  "dtype": "none", "sizing": "none: a cross-encoder keeps no KV",
                                                  "window_freeing": None},
            "max_model_len": max_model_len, "sequences_at_full_context": config.scheduler.max_num_seqs,
            "step_token_budget": budget, "swap_bytes": 0, "prefill_scratch_estimate_bytes": scratch,
            "runtime_estimate_bytes": RUNTIME_ESTIMATE, "total_bytes": total, "available_bytes": available_bytes()}


def describe_plan(result: dict) -> str:
    mb = 2 ** 20
    pool = result["kv_pool"]
    return "\n".join([
        f"model          {result['model']} ({result['quantization']}, {result['dtype']})",
        f"weights        {result['weights_bytes'] / mb:,.0f} MB",
        f"KV pool        {pool['bytes'] / mb:,.0f} MB: {pool['blocks']} blocks, {pool['tokens']:,} tokens of "
        f"{pool['dtype']} ({pool['bytes_per_token']:,} bytes a token)" + (f"; {pool['sizing']}" if pool["sizing"] else ""),
        f"largest batch  {result['sequences_at_full_context']} sequences at the full context of "
        f"{result['max_model_len']:,} tokens; {result['step_token_budget']} tokens a step",
        *([f"windows        {pool['window_freeing']}"] if pool["window_freeing"] != NO_WINDOW else []),
        f"swap space     {result['swap_bytes'] / mb:,.0f} MB",
        f"prefill chunk  ~{result['prefill_scratch_estimate_bytes'] / mb:,.0f} MB of temporaries (estimate)",
        f"runtime        ~{result['runtime_estimate_bytes'] / mb:,.0f} MB",
        f"total          {result['total_bytes'] / mb:,.0f} MB of {(result['available_bytes'] or 0) / mb:,.0f} MB "
        "available now",
    ])
