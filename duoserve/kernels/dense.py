"""Dense linear kernels for the CPU: the fastest one for each number of rows, over one copy of the weight.

Where the CPU has the vector units for the dtype (AVX-512 for float32, AVX512-BF16 for
bfloat16), ``csrc/packed_linear.c`` over a weight repacked once at load (``pack_linear_weight``:
the *packed* dense weight) serves every row count and the plain copy is dropped. Elsewhere, for
the few rows of a decode step a linear layer is bound by the bytes of its weights and
``csrc/small_m_linear.c`` streams them at close to the memory bandwidth; with more rows oneDNN's
GEMM (``mkldnn._linear_pointwise`` over the plain weight) wins; both read the same weight
(``linear_any_m``). The crossovers were measured (BENCHMARKS.md).
"""

from __future__ import annotations

import ctypes
import functools

import torch

from duoserve import envs
from duoserve.kernels.build import load_c_function

_P, _I = ctypes.c_void_p, ctypes.c_int

# the most rows the bandwidth-bound kernel takes, by weight dtype: its crossover with oneDNN on
# whole steps, so that a speculating request's 1 + k tokens and a handful of decodes stay on it
SMALL_M = {torch.float32: 6, torch.bfloat16: 4}

PACK_COLUMNS = 48   # output columns of a block of a packed weight: NB in csrc/packed_linear.c


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


@functools.lru_cache(maxsize=None)
def onednn_runs(dtype: torch.dtype) -> bool:
    """oneDNN's linear takes ``dtype`` on this CPU (it refuses bf16 without AVX-512)."""
    if not onednn_available():
        return False
    return dtype != torch.bfloat16 or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def small_m_linear_kernel():
    return load_c_function("small_m_linear", "small_m_linear", (_P, _P, _P, _P, _I, _I, _I, _I, _I))


def c_small_m_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """x [m, k] @ weight [n, k]^T (+ bias) in the weight's dtype (float32 or bfloat16), or None."""
    fn = small_m_linear_kernel()
    if fn is None:
        return None
    m, k = x.shape
    n = weight.shape[0]
    x = x.contiguous()
    out = torch.empty(m, n, dtype=weight.dtype)
    fn(x.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(), out.data_ptr(),
       int(weight.dtype == torch.bfloat16), m, n, k, torch.get_num_threads())
    return out


def linear_any_m(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., in] @ weight [out, in]^T (+ bias), with the kernel that suits the number of rows."""
    rows = x.reshape(-1, weight.shape[1])  # [m, in]
    if rows.shape[0] <= SMALL_M.get(weight.dtype, 0) and x.dtype == weight.dtype:
        out = c_small_m_linear(rows, weight, bias)
        if out is not None:
            return out.view(*x.shape[:-1], weight.shape[0])
    if not onednn_runs(weight.dtype):
        return torch.nn.functional.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def packed_linear_supported(dtype: torch.dtype) -> bool:
    """``csrc/packed_linear.c`` built for this CPU with the vector units ``dtype`` needs."""
    if dtype not in (torch.float32, torch.bfloat16):
        return False
    fn = load_c_function("packed_linear", "packed_linear_supported", (_I,))
    return fn is not None and fn(int(dtype == torch.bfloat16)) == 1


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """``weight`` [n, k] repacked for ``c_packed_linear`` (a flat tensor of its dtype), or None
    where the packed kernel does not serve it (no kernel for this CPU and dtype, odd k in bfloat16)."""
    bf16 = weight.dtype == torch.bfloat16
    if not envs.DUOSERVE_PACKED_LINEAR:   # for side-by-side measurements
        return None
    if weight.device.type != "cpu" or not packed_linear_supported(weight.dtype) or (bf16 and weight.shape[1] % 2):
        return None
    n, k = weight.shape
    numel = load_c_function("packed_linear", "packed_linear_numel", (_I, _I, _I), ctypes.c_int64)(n, k, int(bf16))
    packed = torch.empty(numel, dtype=weight.dtype)
    pack = load_c_function("packed_linear", "packed_linear_pack", (_P, _P, _I, _I, _I, _I), None)
    plain = weight.contiguous()   # held: the kernel reads it after this line's temporaries are gone
    pack(plain.data_ptr(), packed.data_ptr(), int(bf16), n, k, torch.get_num_threads())
    return packed


def c_packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n: int) -> torch.Tensor:
    """x [..., k] @ W^T (+ bias) over ``pack_linear_weight(W)``, in its dtype: -> [..., n]."""
    fn = load_c_function("packed_linear", "packed_linear", (_P, _P, _P, _P, _I, _I, _I, _I, _I))
    k = x.shape[-1]
    rows = x.reshape(-1, k).to(packed.dtype).contiguous()
    out = torch.empty(rows.shape[0], n, dtype=packed.dtype)
    bias = None if bias is None else bias.to(packed.dtype).contiguous()
    status = fn(rows.data_ptr(), packed.data_ptr(), None if bias is None else bias.data_ptr(), out.data_ptr(),
                int(packed.dtype == torch.bfloat16), rows.shape[0], n, k, torch.get_num_threads())
    if status != 0:
        raise RuntimeError(f"packed_linear cannot run {packed.dtype} weights with k={k} on this build")
    return out.view(*x.shape[:-1], n)
