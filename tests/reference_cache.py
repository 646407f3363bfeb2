"""Reference answers of a peer (transformers), computed once per machine and kept on disk.

Loading a real GGUF file into transformers dequantizes every tensor in Python: about a minute per
file on 2 cores, for a handful of token ids. The ids depend only on the file, the inputs and the
versions of transformers and torch, so they are kept under ``~/.cache/duoserve/test-references``
(``$DUOSERVE_TEST_REFERENCES``), keyed by all of those; a changed file, input or version computes
them again. What is compared is unchanged: our answer against transformers' own.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Callable

REFERENCES_DIR = Path(os.environ.get("DUOSERVE_TEST_REFERENCES",
                                     Path.home() / ".cache" / "duoserve" / "test-references"))


def file_identity(path: Path) -> list:
    stat = path.stat()
    return [str(path.resolve()), stat.st_size, stat.st_mtime_ns]


def cached_reference(name: str, key: Any, compute: Callable[[], Any]) -> Any:
    """``compute()``'s JSON-able result for ``key`` (with the peer's versions added to it), from
    the cache when there, else computed and stored."""
    import torch
    import transformers

    full_key = json.dumps([key, transformers.__version__, torch.__version__], sort_keys=True)
    path = REFERENCES_DIR / f"{name}-{hashlib.sha256(full_key.encode()).hexdigest()[:20]}.json"
    if path.exists():
        stored = json.loads(path.read_text())
        if stored.get("key") == full_key:
            return stored["value"]
    value = compute()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps({"key": full_key, "value": value}))
        partial.replace(path)   # whole or not at all, even beside another process
    except OSError:   # a home that cannot be written: the next run computes them again, nothing else
        pass
    return value
