"""CPU linears: the packed kernel, the small-row C kernel and oneDNN agree with F.linear; one copy of
each weight is kept."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from duoserve.kernels.build import load_torch_op_library
from duoserve.kernels.dense import (SMALL_M, c_packed_linear, c_small_m_linear, linear_any_m, pack_linear_weight,
                                    packed_linear_supported, small_m_linear_kernel)
from duoserve.kernels.linear import CPULinear, PackedEmbedding, cpu_linear, replace_linears
from duoserve.kernels.ops import define_ops

needs_kernel = pytest.mark.needs(small_m_linear_kernel, reason="no C compiler on this machine")


def require_packed(dtype: torch.dtype) -> None:
    """Skip only where the CPU lacks the instructions; where it has them the kernel must build."""
    flag = "avx512_bf16" if dtype == torch.bfloat16 else "avx512f"
    if flag not in Path("/proc/cpuinfo").read_text().split():
        pytest.skip(f"this CPU has no {flag}: the packed kernel cannot run {dtype} here")
    assert packed_linear_supported(dtype), f"the CPU has {flag}: csrc/packed_linear.c must build and serve {dtype}"


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


def test_swap_keeps_one_copy_of_each_weight(smol_llm):
    model = nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 2))
    weights = [model[0].weight.data_ptr(), model[2].weight.data_ptr()]
    assert replace_linears(model, cpu_linear) == 2
    assert isinstance(model[0], CPULinear) and isinstance(model[2], CPULinear)
    for layer, plain in zip((model[0], model[2]), weights):
        if packed_linear_supported(torch.float32):   # the packed copy only: the plain one goes with nn.Linear
            assert layer.weight is None and layer.packed.numel() == 48 * layer.in_features
        else:
            assert layer.packed is None and layer.weight.data_ptr() == plain, "no copy of any weight"
    served = smol_llm.engine.runner.model
    head = served.lm_head   # tied: the runner's CPULinear over the embedding table
    assert isinstance(head, CPULinear)
    if head.packed is None:
        assert head.weight.data_ptr() == served.embed.weight.data_ptr(), "the tied head is the table"
    else:
        assert head.weight is None and served.embed.packed is head.packed, "the embedding reads the packed head"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_embedding_gives_the_rows_of_the_table(dtype):
    require_packed(dtype)
    torch.manual_seed(4)
    table = torch.randn(100, 64).to(dtype)
    embedding = PackedEmbedding.of_head(CPULinear(table, None))
    ids = torch.tensor([[0, 47, 48, 99], [5, 5, 96, 1]])
    assert torch.equal(embedding(ids), table[ids])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_kernel_matches_f_linear_at_every_batch_size(dtype):
    """Every row count from 1 to 20 (tails of the 8-row tile), 33 and 64; output counts that
    are not whole 48-column blocks; with and without bias."""
    require_packed(dtype)
    torch.manual_seed(1)
    for n, k in [(50, 64), (960, 576), (7, 30), (48, 1536)]:
        w, b = torch.randn(n, k).to(dtype), torch.randn(n).to(dtype)
        packed = pack_linear_weight(w)
        for m in [*range(1, 21), 33, 64]:
            x = torch.randn(m, k).to(dtype)
            for bias in (None, b):
                got = c_packed_linear(x, packed, bias, n)
                want = torch.nn.functional.linear(x.double(), w.double(), None if bias is None else bias.double())
                # against the sum of the products' magnitudes: the scale of float32 rounding in a sum
                scale = torch.nn.functional.linear(x.double().abs(), w.double().abs()) + 1
                assert got.dtype == dtype and got.shape == (m, n)
                tolerance = 1e-6 if dtype == torch.float32 else 4e-3  # bf16: the output is rounded to bf16
                assert ((got.double() - want).abs() / scale).max() < tolerance, (n, k, m)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_kernel_answer_does_not_depend_on_the_batch(dtype):
    """A row's result is the same bits alone or among 37 others, at any position in its tile."""
    require_packed(dtype)
    torch.manual_seed(2)
    w = torch.randn(200, 576).to(dtype)
    packed = pack_linear_weight(w)
    x = torch.randn(37, 576).to(dtype)
    together = c_packed_linear(x, packed, None, 200)
    for i in (0, 5, 8, 36):
        assert torch.equal(c_packed_linear(x[i:i + 1], packed, None, 200)[0], together[i])


def test_packed_kernel_refuses_what_it_cannot_run():
    require_packed(torch.bfloat16)
    assert pack_linear_weight(torch.randn(8, 31).to(torch.bfloat16)) is None, "bf16 pairs need an even k"
    assert pack_linear_weight(torch.randn(8, 32).to(torch.float16)) is None
    assert pack_linear_weight(torch.randn(8, 31)) is not None, "float32 takes any k"


def test_cpp_kernel_of_the_linear_op_equals_the_python_kernel():
    """duoserve::linear's C++ kernel (csrc/cpu_ops.cpp, built in CI) computes what linear_any_m does,
    bit for bit: the same small-row C kernel or the same oneDNN call."""
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
        if packed_linear_supported(dtype):   # duoserve::packed_linear: the C++ kernel and c_packed_linear
            packed = pack_linear_weight(w)
            for x in (torch.randn(1, 64).to(dtype), torch.randn(17, 64).to(dtype), x3):
                for bias in (None, b):
                    assert torch.equal(torch.ops.duoserve.packed_linear(x, packed, bias, 40),
                                       c_packed_linear(x, packed, bias, 40))
