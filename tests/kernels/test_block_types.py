"""The one table of GGUF block types (csrc/gguf_blocks.h): what the compiler builds from it, what
Python reads from its text, the dequantizers keyed on it and the gguf package's sizes agree."""

from __future__ import annotations

import argparse
import ctypes

import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from duoserve.engine_args import EngineArgs
from duoserve.gguf_types import block_types
from duoserve.kernels.build import load_c_function
from duoserve.kernels.gguf import BLOCK_TYPES
from duoserve.model import dequant
from tests.kernels.test_gguf import random_blocks

# what gguf_linear.c's fast mode needs of each type, as the kernels were written before the table
SIGNED = {"Q4_0": 8, "Q5_0": 16, "Q8_0": 128, "Q6_K": 32, "Q3_K": 4, "IQ4_NL": 128}


def test_the_header_as_python_reads_it_is_the_table_the_compiler_built():
    info = load_c_function("gguf_linear", "gguf_type_info", (ctypes.c_int, ctypes.POINTER(ctypes.c_int)))
    assert info is not None, "gguf_linear.c did not build"
    row = (ctypes.c_int * 5)()
    ids = sorted(t.id for t in block_types().values())
    assert ids == list(range(len(ids)))   # the C enum's ids run 0..LAST_TYPE
    for name, t in block_types().items():
        assert info(t.id, row) == 0
        assert list(row) == [t.values, t.bytes, t.bias, int(t.half_scales), t.offsets], name
    assert info(len(ids), row) == -1


def test_the_table_agrees_with_the_gguf_package_and_the_kernels_read_it():
    assert len(block_types()) == 11
    for name, t in block_types().items():
        assert GGML_QUANT_SIZES[GGMLQuantizationType[name]] == (t.values, t.bytes), name
        assert t.bias == SIGNED.get(name, 0), name
        assert t.half_scales == (name in ("Q2_K", "Q3_K", "Q6_K")) and t.offsets == (2 if name == "Q2_K" else 1)
    assert BLOCK_TYPES is block_types()
    assert dequant.SUPPORTED_TYPES == ("F32", "F16", "BF16", *sorted(block_types()))
    # each has its torch dequantizer but IQ4_NL, added as one row of the header (the gguf package's)
    assert set(block_types()) - set(dequant._DEQUANTIZERS) == {"IQ4_NL"}
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    quantization = next(a for a in parser._actions if a.dest == "quantization")
    assert all(name in quantization.help for name in block_types())


@pytest.mark.parametrize("type_name", ["Q4_0", "Q5_1", "Q8_0", "Q3_K", "Q6_K", "IQ4_NL"])
def test_a_type_without_a_torch_dequantizer_loads_through_the_gguf_package(type_name, monkeypatch):
    """A new row of the table needs no Python: its weights dequantize with the gguf package's code."""
    raw, reference = random_blocks(type_name, 4, 512)
    monkeypatch.delitem(dequant._DEQUANTIZERS, type_name, raising=False)
    got = dequant.dequantize(raw.reshape(-1), type_name, (4, 512))
    torch.testing.assert_close(got, reference, rtol=0, atol=0)
