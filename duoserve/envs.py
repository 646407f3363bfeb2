"""Every environment variable duoserve reads, declared once: its name, type, default and meaning.

Read them as this module's attributes (``envs.DUOSERVE_C_KERNELS``), as vLLM's ``envs.py`` is
read: each access parses the variable as it is then, so a launcher or a test that sets one is
seen, and a value that does not parse is an error naming the variable. Nothing else in duoserve
reads ``os.environ`` for them (tests/test_envs.py checks, the C sources included: a kernel takes
a parameter). A new variable is one entry of ``VARIABLES`` and its reading where it is used.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable


class EnvError(ValueError):
    """A variable set to a value its type does not take."""


def _switch(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError("1 or 0 (true/false, yes/no, on/off)")


def _text(text: str) -> str:
    return text


@dataclass(frozen=True)
class EnvVar:
    name: str
    parse: Callable[[str], Any]   # the variable's text -> its value (a ValueError for a wrong one)
    default: Any                  # its value where it is unset or empty
    meaning: str

    def read(self) -> Any:
        text = os.environ.get(self.name, "")
        if text == "":
            return self.default
        try:
            return self.parse(text)
        except ValueError as exc:
            allowed = str(exc) if self.parse is _switch else f"a {self.parse.__name__}"
            raise EnvError(f"environment variable {self.name}={text!r}: expected {allowed}") from None


VARIABLES = {var.name: var for var in (
    # the deployment
    EnvVar("DUOSERVE_API_KEY", _text, None, "the server's API key where --api-key is not given"),
    EnvVar("DUOSERVE_AUTH_KEY", _text, None, "the deployment key's secret (engines and frontends), where no "
           "key file is given"),
    EnvVar("DUOSERVE_AUTH_KEY_FILE", _text, None, "the deployment key's file (`duoserve keygen`), where "
           "--auth-key-file is not given"),
    EnvVar("DUOSERVE_SILENCE_TIMEOUT", float, 30.0, "seconds an engine may send nothing, heartbeats included, "
           "before its frontend counts it dead"),
    EnvVar("DUOSERVE_MAX_MESSAGE_BYTES", int, 256 << 20, "the largest ZeroMQ message a peer accepts"),
    EnvVar("DUOSERVE_CONFIGURE_LOGGING", _switch, True, "0: the offline LLM leaves the logging setup alone"),
    # the kernels and where they are built
    EnvVar("DUOSERVE_C_KERNELS", _switch, True, "0: no C kernel is built or loaded; every op runs its torch or "
           "Python path"),
    EnvVar("DUOSERVE_KERNEL_DIR", _text, None, "where the C kernels' libraries are built and looked for "
           "(default: beside the package where it is writable, else $XDG_CACHE_HOME/duoserve/kernels)"),
    EnvVar("XDG_CACHE_HOME", _text, None, "the cache root (default: ~/.cache): tokenizers, compiled steps, "
           "kernels of a read-only install, test references"),
    EnvVar("CC", _text, "gcc", "the C compiler of the kernels (cc where it is missing)"),
    EnvVar("CXX", _text, "g++", "the C++ compiler of the op library (c++ where it is missing)"),
    # what a step runs: switches for side-by-side measurements and tests
    EnvVar("DUOSERVE_PACKED_LINEAR", _switch, True, "0: dense linears keep their plain weights (the small-row "
           "kernel and oneDNN) instead of packing them at load"),
    EnvVar("DUOSERVE_DECODE_STEP", _switch, True, "0: decode steps run the compiled graph, not decode_step.c"),
    EnvVar("DUOSERVE_TILED_PREFILL", _switch, False, "1: prompt runs of attention in tiles (faster, but a "
           "token's result then depends on its batch)"),
    EnvVar("DUOSERVE_COMPILED_GUARDS", _switch, False, "1: the compiled step checks Dynamo's guards at every "
           "call (the tests show no step would recompile)"),
    EnvVar("DUOSERVE_MEASURE_SCRATCH", _switch, False, "1: an engine measures a step's scratch memory at start "
           "instead of estimating it"),
    EnvVar("TORCHINDUCTOR_CPP_WRAPPER", _switch, True, "torch's: 0 compiles steps with Inductor's Python "
           "wrapper"),
    EnvVar("TORCHINDUCTOR_CACHE_DIR", _text, None, "torch's Inductor cache (default here: "
           "$XDG_CACHE_HOME/duoserve/inductor)"),
    # faults the tests inject
    EnvVar("DUOSERVE_FAULT_START_SLEEP", float, 0.0, "tests: seconds an engine sleeps before it starts"),
    EnvVar("DUOSERVE_FAULT_STEP_SLEEP", float, 0.0, "tests: seconds an engine sleeps in each step"),
)}


def __getattr__(name: str) -> Any:
    var = VARIABLES.get(name)
    if var is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return var.read()


def __dir__() -> list[str]:
    return sorted([*globals(), *VARIABLES])
