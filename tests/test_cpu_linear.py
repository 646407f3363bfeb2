"""CPU linears: the small-row C kernel and oneDNN agree with F.linear; weights are shared, never copied."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from duoserve.model.cpu_kernels import c_small_m_linear, small_m_linear_kernel
from duoserve.model.cpu_linear import SMALL_M, CPULinear, use_cpu_linears

needs_kernel = pytest.mark.skipif(small_m_linear_kernel() is None, reason="no C compiler on this machine")


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,n,k", [(1, 960, 576), (2, 37, 40), (3, 8, 100), (4, 1000, 16), (5, 9, 1536)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_small_m_kernel_matches_f_linear(dtype, m, n, k, with_bias):
    torch.manual_seed(m * n + k)
    x, w = torch.randn(m, k).to(dtype), torch.randn(n, k).to(dtype)
    b = torch.randn(n).to(dtype) if with_bias else None
    got = c_small_m_linear(x, w, b)
    want = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
    assert got.dtype == dtype and got.shape == (m, n)
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2  # bf16: the output is rounded to bf16
    assert ((got.float() - want).abs() / (want.abs() + 1)).max() < tolerance


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_linear_every_batch_size(dtype):
    torch.manual_seed(0)
    layer = nn.Linear(64, 48).to(dtype)
    fast = CPULinear(layer.weight, layer.bias)
    for m in (1, SMALL_M[dtype], SMALL_M[dtype] + 1, 33):
        x = torch.randn(m, 64).to(dtype)
        want = torch.nn.functional.linear(x.float(), layer.weight.float(), layer.bias.float())
        assert (fast(x).float() - want).abs().max() < (1e-4 if dtype == torch.float32 else 5e-2)
    assert fast(torch.randn(2, 3, 64).to(dtype)).shape == (2, 3, 48)


def test_swap_shares_the_weights(smol_llm):
    model = nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 2))
    weights = [model[0].weight.data_ptr(), model[2].weight.data_ptr()]
    assert use_cpu_linears(model) == 2
    assert isinstance(model[0], CPULinear) and isinstance(model[2], CPULinear)
    assert [model[0].weight.data_ptr(), model[2].weight.data_ptr()] == weights, "no copy of any weight"
    served = smol_llm.engine.runner.model
    assert served.tied_head.weight.data_ptr() == served.embed.weight.data_ptr(), "the tied head is the table"


def test_cpp_kernel_of_the_linear_op_equals_the_python_kernel():
    """duoserve::linear's C++ kernel (csrc/cpu_ops.cpp, built in CI) computes what linear_any_m does,
    bit for bit: the same small-row C kernel or the same oneDNN call."""
    from duoserve.model.cpu_kernels import load_torch_op_library
    from duoserve.model.cpu_linear import linear_any_m
    from duoserve.model.custom_ops import define_ops

    define_ops()
    assert load_torch_op_library(), "CI has a C++ compiler: the ops' C++ kernels build"
    torch.manual_seed(3)
    for dtype in (torch.float32, torch.bfloat16):
        w, b = torch.randn(40, 64).to(dtype), torch.randn(40).to(dtype)
        for m in (1, 2, 3, 4, 5, 17):
            for bias in (None, b):
                x = torch.randn(m, 64).to(dtype)
                assert torch.equal(torch.ops.duoserve.linear(x, w, bias), linear_any_m(x, w, bias))
        x3 = torch.randn(2, 3, 64).to(dtype)
        assert torch.equal(torch.ops.duoserve.linear(x3, w, b), linear_any_m(x3, w, b))
