"""Build and load the C and C++ kernels of ``csrc/``, compiled on first use with the system compiler.

Each C file is built into its own shared library and loaded with ctypes (no torch headers, so
each compiles in about a second); ``csrc/cpu_ops.cpp`` with all of them is built against torch's
headers once and loaded as a torch library (it registers the C++ kernels of ``duoserve.kernels.ops``).
Libraries live in ``kernel_dir()`` (beside the installed package, where ``duoserve build-kernels``
puts them at install, so a first start with an empty home builds nothing) under a tag of their
sources, csrc/'s headers, the flags, the CPU, the compilers and (for the C++ one) the torch
version, so a library built from other sources or for another CPU is never loaded. Without a
compiler, or with ``DUOSERVE_C_KERNELS=0``, the callers run their torch or Python paths; a failed
build says so once in the log.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import time
from functools import lru_cache
from pathlib import Path
from typing import Callable

import torch

from duoserve import envs

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"

C_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC"]


def c_flags(march: str = "native") -> list[str]:
    """C_FLAGS for the instruction set ``march`` (gcc's name): native for what runs; another one
    (haswell: AVX2 without AVX-512, x86-64: none of either) builds the paths other CPUs take, so
    that they are tested here."""
    return [f"-march={march}" if flag.startswith("-march=") else flag for flag in C_FLAGS]

# the C sources of the C++ op library, linked into it
OP_LIBRARY_SOURCES = ("small_m_linear", "packed_linear", "gguf_linear", "paged_decode", "paged_prefill", "glue",
                      "decode_step", "lora")

# what a ctypes library links besides csrc/<name>.c
_LINKED = {"paged_decode": ("paged_prefill",)}


def c_kernels_enabled() -> bool:
    """False with ``DUOSERVE_C_KERNELS=0``: every caller runs its torch or Python path."""
    return envs.DUOSERVE_C_KERNELS


# beside the package: built once per install (per machine), whatever the home directory
PACKAGE_KERNEL_DIR = Path(__file__).parent / "built"


def kernel_dir() -> Path:
    """Where the libraries are built and looked for: ``$DUOSERVE_KERNEL_DIR``; else ``built/`` beside
    this file where the package's directory is writable (an editable install, a virtualenv); else
    ``$XDG_CACHE_HOME/duoserve/kernels`` (``~/.cache`` without it) for a read-only system install."""
    if envs.DUOSERVE_KERNEL_DIR:
        return Path(envs.DUOSERVE_KERNEL_DIR)
    if os.access(PACKAGE_KERNEL_DIR if PACKAGE_KERNEL_DIR.exists() else PACKAGE_KERNEL_DIR.parent, os.W_OK):
        return PACKAGE_KERNEL_DIR
    return Path(envs.XDG_CACHE_HOME or Path.home() / ".cache") / "duoserve" / "kernels"


def compilers() -> tuple[str | None, str | None]:
    """The C and C++ compilers (``$CC``, ``$CXX``, else gcc/cc and g++/c++), None where absent."""
    cc = shutil.which(envs.CC) or shutil.which("cc")
    cxx = shutil.which(envs.CXX) or shutil.which("c++")
    return cc, cxx


@lru_cache(maxsize=None)
def cpu_identity() -> str:
    """The CPU's model and instruction-set flags (Linux's /proc/cpuinfo, else the platform's name):
    in every library's tag, because -march=native builds for the CPU at hand and a library kept
    beside the package must not be loaded after the machine under it changes."""
    import platform

    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    wanted = ("model name", "flags", "isa", "Features")
    return "\n".join(dict.fromkeys(line for line in lines if line.split(":")[0].strip() in wanted))


def _cached_build(stem: str, sources: list[Path], salt: str,
                  stages: Callable[[Path, Path], list[list[list[str]]]], flags: list[str] = C_FLAGS) -> Path | None:
    """``<cache>/<stem>-<tag>.so``, built by ``stages(tmp_dir, output)`` unless there: stage after
    stage, the commands of a stage run side by side (a first start waits for this, and a machine's
    cores compile separate files at once). The tag covers the sources, the shared headers of
    csrc/, the C flags, the CPU and ``salt`` (compilers, torch version). None, with one log line,
    when a command fails."""
    text = b"".join(p.read_bytes() for p in [*sources, *sorted(CSRC.glob("*.h"))])
    tag = hashlib.sha256(text + " ".join(flags).encode() + (salt + cpu_identity()).encode()).hexdigest()[:16]
    target = kernel_dir() / f"{stem}-{tag}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    logger.info("building the C kernels of %s (once; cached in %s)", stem, target.parent)
    start = time.monotonic()
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        partial = Path(tmp) / target.name
        for stage in stages(Path(tmp), partial):
            running = [subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                       for cmd in stage]
            errors = [proc.communicate()[1] for proc in running]
            failed = [err for proc, err in zip(running, errors) if proc.returncode != 0]
            if failed:
                logger.warning("building %s failed, the torch/Python path runs instead: %s", stem, failed[0][-2000:])
                return None
        os.replace(partial, target)  # atomic: concurrent builders never load a half-written file
    logger.info("built %s in %.1fs", target.name, time.monotonic() - start)
    return target


def _build_c(name: str, march: str = "native") -> Path | None:
    compiler = compilers()[0]
    if compiler is None:
        logger.info("no C compiler found: %s runs on the torch path", name)
        return None
    sources = [CSRC / f"{c}.c" for c in (name, *_LINKED.get(name, ()))]
    flags = c_flags(march)
    return _cached_build(name if march == "native" else f"{name}-{march}", sources, compiler,
                         lambda tmp, out: [[[compiler, *flags, "-shared", *map(str, sources), "-o", str(out), "-lm"]]],
                         flags)


@lru_cache(maxsize=None)
def op_library() -> Path | None:
    """``csrc/cpu_ops.cpp`` built with the C sources it calls into one library against this torch
    (once per machine: cached); None, with one log line, where it cannot be."""
    if not c_kernels_enabled():
        return None
    cc, cxx = compilers()
    if cc is None or cxx is None:
        logger.info("no C/C++ compiler found: the ops of cpu_ops.cpp run their Python kernels")
        return None
    cpp, sources = CSRC / "cpu_ops.cpp", [CSRC / f"{c}.c" for c in OP_LIBRARY_SOURCES]
    torch_dir = Path(torch.__file__).parent

    def stages(tmp: Path, out: Path) -> list[list[list[str]]]:
        """Every object at once (the C++ file against torch's headers is the longest), then the link."""
        objects = [tmp / f"{c.stem}.o" for c in sources]
        cpp_object = tmp / "cpu_ops.o"
        abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
        return [[[cxx, "-O2", "-std=c++17", "-fPIC", f"-D_GLIBCXX_USE_CXX11_ABI={abi}", f"-I{torch_dir / 'include'}",
                  "-c", str(cpp), "-o", str(cpp_object)],
                 *([cc, *C_FLAGS, "-c", str(c), "-o", str(o)] for c, o in zip(sources, objects))],
                [[cxx, "-shared", "-fPIC", str(cpp_object), *map(str, objects), "-o", str(out),
                  f"-L{torch_dir / 'lib'}", "-ltorch_cpu", "-lc10", "-fopenmp", "-Wl,-Bsymbolic"]]]

    return _cached_build("cpu_ops", [cpp, *sources], f"{cc}{cxx}{torch.__version__}", stages)


_CONFIGURED: set[Path] = set()


def _configured(library: ctypes.CDLL, path: Path) -> ctypes.CDLL:
    """``library`` given, the first time it is loaded, the switches its C code takes from the
    environment (the C sources read none): paged_prefill.c's tiles."""
    if path not in _CONFIGURED:
        _CONFIGURED.add(path)
        switch = getattr(library, "paged_set_tiled_prefill", None)
        if switch is not None:
            switch.argtypes, switch.restype = [ctypes.c_int], None
            switch(int(envs.DUOSERVE_TILED_PREFILL))
    return library


@lru_cache(maxsize=None)
def load_torch_op_library() -> bool:
    """Load ``op_library()`` into torch (it registers op kernels); False, with one log line, where
    it cannot be built or loaded."""
    target = op_library()
    if target is None:
        return False
    try:
        torch.ops.load_library(str(target))
        _configured(ctypes.CDLL(str(target)), target)
    except (OSError, RuntimeError) as exc:
        logger.warning("cannot load %s, its ops run their Python kernels: %s", target.name, exc)
        return False
    return True


@lru_cache(maxsize=None)
def load_c_function(name: str, symbol: str, argtypes: tuple, restype=ctypes.c_int,
                    march: str = "native") -> Callable | None:
    """The ctypes function ``symbol`` of ``csrc/<name>.c`` built for ``march`` (see c_flags), or
    None when C kernels are off or cannot be built."""
    if not c_kernels_enabled():
        return None
    try:
        # for this machine, the op library's copy of the file: one build on a first start, not two
        in_op_library = march == "native" and {name, *_LINKED.get(name, ())} <= set(OP_LIBRARY_SOURCES)
        path = (in_op_library and op_library()) or _build_c(name, march)
        if path is None:
            return None
        fn = getattr(_configured(ctypes.CDLL(str(path)), path), symbol)
    except (OSError, AttributeError) as exc:
        logger.warning("cannot load the C kernel %s, using the torch path: %s", name, exc)
        return None
    fn.argtypes = list(argtypes)
    fn.restype = restype
    return fn
