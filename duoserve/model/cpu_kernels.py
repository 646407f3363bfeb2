"""Optional C kernels for the CPU, compiled on first use with the system C compiler.

``csrc/paged_decode.c`` (decode attention that reads K and V straight from their blocks),
``csrc/small_m_linear.c`` (linear layers over the few rows of a decode step, at the
memory bandwidth), ``csrc/packed_linear.c`` (linear layers over weights repacked for the
vector units, any number of rows) and ``csrc/gguf_linear.c`` (linear layers from GGUF blocks) are each
built once per source version and machine into ``~/.cache/duoserve/kernels`` and loaded
with ctypes (no torch headers, so each compiles in about a second). Without a compiler,
or with ``DUOSERVE_C_KERNELS=0``, the torch paths run instead; a failed build says so once
in the log. ``csrc/cpu_ops.cpp`` is the one C++ file: the CPU kernels of the ops
``duoserve::linear`` and ``duoserve::gguf_linear`` over small_m_linear.c and gguf_linear.c,
built against torch's headers (~15 s, once) and loaded as a torch library; without a C++
compiler the ops' Python kernels run.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import Callable

import torch

from duoserve.model.paths import cache_dir

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"


C_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC"]


def _compilers() -> tuple[str | None, str | None]:
    cc = shutil.which(os.environ.get("CC", "gcc")) or shutil.which("cc")
    cxx = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++")
    return cc, cxx


def _cached_build(stem: str, sources: list[Path], salt: str,
                  commands: Callable[[Path, Path], list[list[str]]]) -> Path | None:
    """``~/.cache/duoserve/kernels/<stem>-<tag>.so``, built by ``commands(tmp_dir, output)`` unless
    there; the tag covers the sources, the shared headers of csrc/ and ``salt`` (compilers,
    torch version). None, with one log line, when a command fails."""
    text = b"".join(p.read_bytes() for p in [*sources, *sorted(_CSRC.glob("*.h"))])
    tag = hashlib.sha256(text + salt.encode()).hexdigest()[:16]
    target = cache_dir("kernels") / f"{stem}-{tag}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        partial = Path(tmp) / target.name
        for cmd in commands(Path(tmp), partial):
            result = subprocess.run(cmd, capture_output=True, text=True)
            if result.returncode != 0:
                logger.warning("building %s failed, the torch/Python path runs instead: %s", stem,
                               result.stderr[-2000:])
                return None
        os.replace(partial, target)  # atomic: concurrent builders never load a half-written file
    return target


# what a ctypes library links besides csrc/<name>.c
_LINKED = {"paged_decode": ("paged_prefill",)}


def _build(source: Path) -> Path | None:
    compiler = _compilers()[0]
    if compiler is None:
        logger.info("no C compiler found: %s runs on the torch path", source.stem)
        return None
    sources = [source, *(_CSRC / f"{c}.c" for c in _LINKED.get(source.stem, ()))]
    return _cached_build(source.stem, sources, compiler,
                         lambda tmp, out: [[compiler, *C_FLAGS, "-shared", *map(str, sources), "-o", str(out), "-lm"]])


@lru_cache(maxsize=None)
def load_torch_op_library(name: str = "cpu_ops",
                          c_sources: tuple[str, ...] = ("small_m_linear", "packed_linear", "gguf_linear",
                                                           "paged_decode", "paged_prefill", "decode_step")) -> bool:
    """Build ``csrc/<name>.cpp`` with ``csrc/<c_sources>.c`` into one library against this torch and
    load it (it registers op kernels); False, with one log line, where it cannot be."""
    if os.environ.get("DUOSERVE_C_KERNELS", "1") == "0":
        return False
    cc, cxx = _compilers()
    if cc is None or cxx is None:
        logger.info("no C/C++ compiler found: the ops of %s run their Python kernels", name)
        return False
    cpp, sources = _CSRC / f"{name}.cpp", [_CSRC / f"{c}.c" for c in c_sources]
    torch_dir = Path(torch.__file__).parent

    def commands(tmp: Path, out: Path) -> list[list[str]]:
        objects = [tmp / f"{c.stem}.o" for c in sources]
        abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
        return [*([cc, *C_FLAGS, "-c", str(c), "-o", str(o)] for c, o in zip(sources, objects)),
                [cxx, "-O2", "-std=c++17", "-shared", "-fPIC", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
                 f"-I{torch_dir / 'include'}", str(cpp), *map(str, objects), "-o", str(out),
                 f"-L{torch_dir / 'lib'}", "-ltorch_cpu", "-lc10", "-fopenmp", "-Wl,-Bsymbolic"]]

    target = _cached_build(name, [cpp, *sources], f"{cc}{cxx}{torch.__version__}", commands)
    if target is None:
        return False
    try:
        torch.ops.load_library(str(target))
    except (OSError, RuntimeError) as exc:
        logger.warning("cannot load %s, its ops run their Python kernels: %s", target.name, exc)
        return False
    return True


@lru_cache(maxsize=None)
def _load(name: str, symbol: str, argtypes: tuple, restype=ctypes.c_int):
    """The ctypes function ``symbol`` of ``csrc/<name>.c``, or None when C kernels are off or
    cannot be built."""
    if os.environ.get("DUOSERVE_C_KERNELS", "1") == "0":
        return None
    try:
        path = _build(_CSRC / f"{name}.c")
        if path is None:
            return None
        fn = getattr(ctypes.CDLL(str(path)), symbol)
    except (OSError, AttributeError) as exc:
        logger.warning("cannot load the C kernel %s, using the torch path: %s", name, exc)
        return None
    fn.argtypes = list(argtypes)
    fn.restype = restype
    return fn


_P, _I = ctypes.c_void_p, ctypes.c_int


def paged_decode_kernel():
    return _load("paged_decode", "paged_decode_attention",
                 (_P, _P, _P, _I, _P, _P, _P, _I, _I, _I, _I, _I, _I, ctypes.c_float, _I))


@lru_cache(maxsize=1)
def decode_attention_op():
    """``duoserve::decode_attention`` with its C++ kernel (csrc/cpu_ops.cpp), or None without it."""
    from duoserve.model.custom_ops import define_ops

    define_ops()
    if not torch._C._dispatch_has_kernel_for_dispatch_key("duoserve::decode_attention", "CPU"):
        return None
    return torch.ops.duoserve.decode_attention.default


def small_m_linear_kernel():
    return _load("small_m_linear", "small_m_linear", (_P, _P, _P, _P, _I, _I, _I, _I, _I))


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


def packed_linear_supported(dtype: torch.dtype) -> bool:
    """``csrc/packed_linear.c`` built for this CPU with the vector units ``dtype`` needs."""
    if dtype not in (torch.float32, torch.bfloat16):
        return False
    fn = _load("packed_linear", "packed_linear_supported", (_I,))
    return fn is not None and fn(int(dtype == torch.bfloat16)) == 1


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """``weight`` [n, k] repacked for ``c_packed_linear`` (a flat tensor of its dtype), or None
    where the packed kernel does not serve it (no kernel for this CPU and dtype, odd k in bfloat16)."""
    bf16 = weight.dtype == torch.bfloat16
    if os.environ.get("DUOSERVE_PACKED_LINEAR", "1") == "0":   # for side-by-side measurements
        return None
    if weight.device.type != "cpu" or not packed_linear_supported(weight.dtype) or (bf16 and weight.shape[1] % 2):
        return None
    n, k = weight.shape
    numel = _load("packed_linear", "packed_linear_numel", (_I, _I, _I), ctypes.c_int64)(n, k, int(bf16))
    packed = torch.empty(numel, dtype=weight.dtype)
    pack = _load("packed_linear", "packed_linear_pack", (_P, _P, _I, _I, _I, _I), None)
    plain = weight.contiguous()   # held: the kernel reads it after this line's temporaries are gone
    pack(plain.data_ptr(), packed.data_ptr(), int(bf16), n, k, torch.get_num_threads())
    return packed


def c_packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n: int) -> torch.Tensor:
    """x [..., k] @ W^T (+ bias) over ``pack_linear_weight(W)``, in its dtype: -> [..., n]."""
    fn = _load("packed_linear", "packed_linear", (_P, _P, _P, _P, _I, _I, _I, _I, _I))
    k = x.shape[-1]
    rows = x.reshape(-1, k).to(packed.dtype).contiguous()
    out = torch.empty(rows.shape[0], n, dtype=packed.dtype)
    bias = None if bias is None else bias.to(packed.dtype).contiguous()
    status = fn(rows.data_ptr(), packed.data_ptr(), None if bias is None else bias.data_ptr(), out.data_ptr(),
                int(packed.dtype == torch.bfloat16), rows.shape[0], n, k, torch.get_num_threads())
    if status != 0:
        raise RuntimeError(f"packed_linear cannot run {packed.dtype} weights with k={k} on this build")
    return out.view(*x.shape[:-1], n)


def c_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor | None:
    """q: [num_seqs, num_heads, head_dim] -> out [num_seqs, num_heads * head_dim] float32, or None."""
    fn = paged_decode_kernel()
    if fn is None or q.device.type != "cpu" or k_cache.dtype not in (torch.float32, torch.bfloat16):
        return None
    num_seqs, num_heads, head_dim = q.shape
    q32 = q.float().contiguous()
    out = torch.empty_like(q32)
    status = fn(q32.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), int(k_cache.dtype == torch.bfloat16),
                block_tables.data_ptr(), seq_lens.data_ptr(), out.data_ptr(), num_seqs, num_heads,
                k_cache.shape[2], head_dim, k_cache.shape[1], block_tables.shape[1], scale,
                torch.get_num_threads())
    if status != 0:
        return None
    return out.view(num_seqs, num_heads * head_dim)
