"""duoserve's GGUF header reader gives what the gguf package's reader gives, and says what is wrong
with a file it cannot read."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGUFReader

from duoserve.config import ModelConfig
from duoserve.errors import ModelLoadError
from duoserve.model.gguf_file import read_gguf
from duoserve.model.paths import default_model_path
from duoserve.worker.backends import load_model
from tests.model.test_gguf import write_gguf
from tests.model.test_gguf_tokenizers import add_gemma_tokenizer


def same_as_gguf_reader(path) -> None:
    ours, theirs = read_gguf(path), GGUFReader(str(path))
    assert ours.meta == {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert [(t.name, t.tensor_type, t.shape) for t in ours.tensors] == \
        [(t.name, t.tensor_type, tuple(int(d) for d in t.shape)) for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors):
        assert np.array_equal(a.data, b.data.view(np.uint8).ravel()), a.name
        assert a.n_bytes == int(b.n_bytes) and a.n_elements == int(b.n_elements)


def test_header_equals_the_gguf_packages(tiny_dir, tmp_path):
    """Strings, string arrays (a vocabulary), float and int arrays (scores, token types), booleans,
    F32 and quantized tensors: the default model's file and a tiny Gemma one."""
    same_as_gguf_reader(default_model_path())
    path = tmp_path / "tiny.gguf"
    write_gguf(tiny_dir(kind="gemma3", query_pre_attn_scalar=16), path, "Q8_0", tokenizer=add_gemma_tokenizer)
    same_as_gguf_reader(path)


def test_a_file_cut_short_or_not_gguf_is_a_load_error(tiny_dir, tmp_path):
    whole = tmp_path / "whole.gguf"
    write_gguf(tiny_dir(kind="llama"), whole, "Q8_0")
    data = whole.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match=r"cut.gguf is not a readable GGUF file: tensor .* runs past the end"):
        load_model(ModelConfig(model=str(cut)))
    header = tmp_path / "header.gguf"
    header.write_bytes(data[:300])
    with pytest.raises(ModelLoadError, match=r"header.gguf is not a readable GGUF file: the header ends early"):
        load_model(ModelConfig(model=str(header)))
    other = tmp_path / "other.gguf"
    other.write_bytes(b"GGML" + data[4:])
    with pytest.raises(ModelLoadError, match=r"other.gguf is not a readable GGUF file: no GGUF magic"):
        load_model(ModelConfig(model=str(other)))
