"""How a model file says its embeddings are pooled, where it says so.

A GGUF file: ``{arch}.pooling_type`` (llama.cpp's enum: 1 mean, 3 last; none and CLS name no
pooling this engine does for a causal model). A Hugging Face directory: sentence-transformers'
``modules.json`` naming a Pooling module whose ``config.json`` sets ``pooling_mode_mean_tokens``
or ``pooling_mode_lasttoken`` (Qwen3-Embedding's). Anything else says nothing (None): the server's
``--pooling`` decides, ``last`` by default.
"""

from __future__ import annotations

import json
from pathlib import Path

from duoserve.model.gguf_file import read_gguf

_GGUF_POOLING = {1: "mean", 3: "last"}
_ST_MODES = {"pooling_mode_mean_tokens": "mean", "pooling_mode_lasttoken": "last"}


def declared_pooling(path: Path, gguf_meta: dict | None = None) -> str | None:
    """``gguf_meta``: the file's metadata where the caller has read it already (a GGUF header of
    262,144 tokens takes some 0.4 s to parse again)."""
    try:
        if not path.is_file():
            return _from_sentence_transformers(path)
        return _from_gguf_meta(read_gguf(path).meta if gguf_meta is None else gguf_meta)
    except (OSError, ValueError, KeyError, TypeError):   # a file that says nothing readable says nothing
        return None


def _from_gguf_meta(meta: dict) -> str | None:
    value = next((v for k, v in meta.items() if k.endswith(".pooling_type")), None)
    return _GGUF_POOLING.get(int(value)) if value is not None else None


def _from_sentence_transformers(directory: Path) -> str | None:
    modules = directory / "modules.json"
    if not modules.exists():
        return None
    for module in json.loads(modules.read_text()):
        if module.get("type", "").endswith("Pooling"):
            config = json.loads((directory / module.get("path", "") / "config.json").read_text())
            chosen = [mode for key, mode in _ST_MODES.items() if config.get(key)]
            return chosen[0] if len(chosen) == 1 else None
    return None
