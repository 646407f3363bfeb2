"""The API process's tokenizer backends: parsed once, and while the engines load.

An engine sends its tokenizer's JSON in ``EngineReady`` and, where that JSON is a file (a GGUF
file's tokenizer, rebuilt once and kept: ``duoserve.model.tokenizer``), that file's path. A
frontend that launches engines on this host starts parsing the file as soon as their processes
are started (``preload``), so the ready answer finds it parsed instead of waiting on a parse
that came after it (Gemma 3's 262,144 tokens: about 1.2 s on 2 cores, all of it holding the GIL,
which is why this happens while the engines load and nothing else waits on this process). Every
engine client of the process shares one parse of a file.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

from duoserve.errors import DuoserveError
from duoserve.messages import EngineReady
from duoserve.model.paths import resolve_model_path
from duoserve.model.tokenizer import backend_from_json, gguf_tokenizer_cache, parsed

logger = logging.getLogger(__name__)

_parsed: dict[str, HFTokenizer] = {}          # tokenizer file -> its backend
_parsing: dict[str, threading.Thread] = {}    # tokenizer file -> the thread parsing it


def preload(model: str | None) -> None:
    """Start parsing the kept tokenizer of ``model`` (a GGUF file launched engines load) in a
    thread; nothing where the model is a directory or its tokenizer is not kept yet."""
    try:
        path = resolve_model_path(model)
        if not path.is_file():
            return
        cache = gguf_tokenizer_cache(path)
    except (DuoserveError, OSError):
        return
    key = str(cache)
    if cache.exists() and key not in _parsed and key not in _parsing:
        thread = threading.Thread(target=_parse, args=(cache,), name="tokenizer-preload", daemon=True)
        _parsing[key] = thread
        thread.start()


def _parse(path: Path) -> None:
    try:
        _parsed[str(path)] = parsed(HFTokenizer.from_file(str(path)))
    except Exception as exc:  # noqa: BLE001 - the engine's JSON is parsed instead
        logger.info("cannot parse %s ahead of the engine (%s): its ready message's copy is parsed", path, exc)


def backend_of(ready: EngineReady) -> HFTokenizer:
    """The backend of the tokenizer ``ready`` carries: the parse of its file where there is one
    (waited for if still running), else its JSON parsed (and kept under its file)."""
    key = ready.tokenizer_file
    if key is not None:
        thread = _parsing.pop(key, None)
        if thread is not None:
            thread.join()
        if key in _parsed:
            return _parsed[key]
    backend = backend_from_json(ready.tokenizer_json)
    if key is not None:
        _parsed[key] = backend
    return backend

