"""Optional C kernels for the CPU, compiled on first use with the system C compiler.

The paged decode attention in ``csrc/paged_decode.c`` reads K and V straight from
their blocks; it is built once per source version into ``~/.cache/duoserve`` and
loaded with ctypes (no torch headers, so it compiles in about a second). Without a
compiler, or with ``DUOSERVE_C_KERNELS=0``, the torch reference path is used.
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

import torch

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "paged_decode.c"


def _cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "duoserve" / "kernels"


def _build(source: Path) -> Path | None:
    compiler = shutil.which(os.environ.get("CC", "gcc")) or shutil.which("cc")
    if compiler is None:
        logger.info("no C compiler found: decode attention uses the torch path")
        return None
    text = source.read_bytes()
    tag = hashlib.sha256(text + compiler.encode()).hexdigest()[:16]
    target = _cache_dir() / f"{source.stem}-{tag}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        partial = Path(tmp) / target.name
        cmd = [compiler, "-O3", "-march=native", "-ffast-math", "-fopenmp", "-shared", "-fPIC",
               str(source), "-o", str(partial), "-lm"]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            logger.warning("building %s failed, using the torch path: %s", source.name, result.stderr[-2000:])
            return None
        os.replace(partial, target)  # atomic: concurrent builders never load a half-written file
    return target


@lru_cache(maxsize=1)
def paged_decode_kernel():
    """The ctypes function, or None when C kernels are off or cannot be built."""
    if os.environ.get("DUOSERVE_C_KERNELS", "1") == "0":
        return None
    try:
        path = _build(_SOURCE)
        if path is None:
            return None
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        logger.warning("cannot load the C decode kernel, using the torch path: %s", exc)
        return None
    fn = lib.paged_decode_attention
    p, i = ctypes.c_void_p, ctypes.c_int
    fn.argtypes = [p, p, p, i, p, p, p, i, i, i, i, i, i, ctypes.c_float, i]
    fn.restype = ctypes.c_int
    return fn


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
