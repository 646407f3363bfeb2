"""The process's heap: memory freed after a one-time peak handed back to the OS.

glibc keeps the pages of freed allocations for later ones, so a peak at start stays resident for
the process's life: loading weights, or parsing a tokenizer (Gemma 3's 515,000 merges leave about
260 MB of freed pages behind a 110 MB tokenizer, in the API process and the engine alike). No torch
here: the API process calls it too.
"""

from __future__ import annotations

import ctypes


def release_free_memory() -> None:
    """Hand freed memory back to the OS (glibc keeps freed heap pages otherwise)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass
