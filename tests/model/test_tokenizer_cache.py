"""A GGUF file's tokenizer is rebuilt from its metadata once, then read from the cache (Gemma's
merges take seconds to rebuild in Python: a later start skips them)."""

from __future__ import annotations

import shutil

import duoserve.model.tokenizer as tokenizer_module
from duoserve.model.gguf_file import read_gguf
from duoserve.model.paths import default_model_path
from duoserve.model.tokenizer import gguf_tokenizer_cache, tokenizer_from_gguf

TEXTS = ["Hello, world!", "naïve café, 東京 🙂 \t tabs\n\nand", "<|im_start|>user\nhi<|im_end|>\n"]


def same_tokenizer(a, b) -> None:
    assert [a.encode(t) for t in TEXTS] == [b.encode(t) for t in TEXTS]
    assert (a.bos_token_id, a.eos_token_ids, a.chat_template, a.add_bos_token, a.vocab_size, a.special_token_ids) == \
           (b.bos_token_id, b.eos_token_ids, b.chat_template, b.add_bos_token, b.vocab_size, b.special_token_ids)


def test_rebuilt_once_then_read_from_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = default_model_path()
    meta = read_gguf(path).meta
    first = tokenizer_from_gguf(meta, (), path)
    cached = gguf_tokenizer_cache(path)
    assert cached.parent == tmp_path / "cache" / "duoserve" / "tokenizers" and cached.exists()
    rebuilds = []
    build = tokenizer_module._gguf_backend
    monkeypatch.setattr(tokenizer_module, "_gguf_backend", lambda meta: rebuilds.append(1) or build(meta))
    same_tokenizer(tokenizer_from_gguf(meta, (), path), first)
    assert rebuilds == [], "a later load reads the cache"
    cached.write_text('{"not": "a tokenizer"')                 # damaged: rebuilt and written again
    same_tokenizer(tokenizer_from_gguf(meta, (), path), first)
    assert rebuilds == [1]
    same_tokenizer(tokenizer_from_gguf(meta, (), path), first)
    assert rebuilds == [1]
    copy = tmp_path / "copy.gguf"                               # another file: its own entry
    shutil.copyfile(path, copy)
    assert gguf_tokenizer_cache(copy) != cached
    same_tokenizer(tokenizer_from_gguf(meta, (), copy), first)
    assert rebuilds == [1, 1]


def test_without_a_file_nothing_is_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    meta = read_gguf(default_model_path()).meta
    tokenizer_from_gguf(meta, ())
    assert not (tmp_path / "cache").exists()


def test_a_kept_tokenizer_is_parsed_on_first_use(tmp_path, monkeypatch):
    """A later load takes the kept facts (vocabulary size, special ids, the vocabulary's digest)
    and parses the tokenizer only once it is used: an engine that never tokenizes never parses
    it. A kept file damaged after the load that trusted it is rebuilt from the GGUF file on use."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = default_model_path()
    meta = read_gguf(path).meta
    first = tokenizer_from_gguf(meta, (), path)
    later = tokenizer_from_gguf(meta, (), path)
    cached = gguf_tokenizer_cache(path)
    assert later._backend is None and later.source_file == cached == first.source_file
    assert later.vocabulary_digest() == first.vocabulary_digest() and later._backend is None
    same_tokenizer(later, first)
    assert later._backend is not None
    cached.write_bytes(b" " * cached.stat().st_size)             # damaged in place, same size
    damaged = tokenizer_from_gguf(meta, (), path)
    assert damaged._backend is None, "the facts still match the file's size: trusted until used"
    same_tokenizer(damaged, first)
    assert tokenizer_from_gguf(meta, (), path).backend.to_str() == first.backend.to_str(), "kept again"
