"""A layer's small ops (``duoserve.kernels.glue``): their C++ kernels (csrc/glue.c, which the C++
decode step calls too: ``tests/worker/test_fused_decode_gguf.py`` holds those bits equal) compute
the model's own modules (``duoserve.model.layers``, Hugging Face's arithmetic) within a rounding
on the strided views the model hands them; and a compiled function calling them computes what it
computes eager, where Inductor's own fused loops over the model's functions do not."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from duoserve.kernels.glue import (OpGeluTanhAndMul, OpOffsetRMSNorm, OpRMSNorm, OpRotary, OpSiluAndMul,
                                   glue_ops_available)
from duoserve.model import layers

needs_library = pytest.mark.needs(glue_ops_available, reason="no C++ compiler on this machine")
DTYPES = [torch.float32, torch.bfloat16]


def inputs(dtype: torch.dtype, tokens: int = 37):
    """What a layer of the default model's shape hands the ops: slices of a fused projection."""
    torch.manual_seed(tokens)
    qkv = torch.randn(tokens, 15 * 64 + 5 * 64 + 5 * 64).to(dtype)
    qk = qkv[:, : 20 * 64].reshape(tokens, 20, 64)            # strided: a view into qkv
    positions = torch.randint(0, 2048, (tokens,))
    freqs = positions[:, None].float() * (1e4 ** (-torch.arange(0, 64, 2) / 64))[None]
    cos = torch.cat([freqs, freqs], -1).cos().to(dtype)[:, None]
    sin = torch.cat([-freqs.sin(), freqs.sin()], -1).to(dtype)[:, None]
    hidden = torch.randn(tokens, 576).to(dtype)
    weight = (1 + 0.1 * torch.randn(576)).to(dtype)
    gate_up = (3 * torch.randn(tokens, 2 * 1536)).to(dtype)
    return qk, cos, sin, hidden, weight, gate_up


class ModelFunctions:
    rms_norm, rotary, silu_mul = layers.rms_norm, layers.apply_rotary, layers.silu_mul


def calls(qk, cos, sin, hidden, weight, gate_up, ops):
    return (ops.rms_norm(hidden, weight, 1e-5), ops.rms_norm(qk[:, :15], weight[:64], 1e-6),
            ops.rotary(qk, cos, sin), ops.silu_mul(gate_up))


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_model_functions_are_hugging_faces_arithmetic(dtype):
    qk, cos, sin, hidden, weight, gate_up = inputs(dtype)
    norm, _, rotated, act = calls(qk, cos, sin, hidden, weight, gate_up, ModelFunctions)
    variance = hidden.float().pow(2).mean(-1, keepdim=True)        # LlamaRMSNorm, as written there
    want_norm = weight * (hidden.float() * torch.rsqrt(variance + 1e-5)).to(dtype)
    torch.testing.assert_close(norm, want_norm, rtol=0, atol=2e-6 if dtype == torch.float32 else 1e-2)
    rotate_half = torch.cat([-qk[..., 32:], qk[..., :32]], -1)     # and its rotary, sin unsigned
    unsigned_sin = torch.cat([-sin[..., :32], sin[..., 32:]], -1)
    tolerance = dict(rtol=0, atol=1e-6) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)  # a rounding
    torch.testing.assert_close(rotated, qk * cos + rotate_half * unsigned_sin, **tolerance)
    gate, up = gate_up.chunk(2, -1)
    assert torch.equal(act, F.silu(gate) * up)


@needs_library
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 37])
def test_the_ops_compute_the_model_functions_within_a_rounding(dtype, tokens):
    """Within a rounding, not to the bit: glue.c sums and rounds in its own order (one order for the
    eager, compiled and native steps), not ATen's."""
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)
    args = inputs(dtype, tokens)
    got = calls(*args, ops=torch.ops.duoserve)
    want = calls(*args, ops=ModelFunctions)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape and g.is_contiguous()   # as the shape functions say
        torch.testing.assert_close(g, w, **tolerance)
    qk, cos, sin, hidden, weight, gate_up = args
    norm = layers.RMSNorm(576, 1e-5).to(dtype)
    norm.weight.copy_(weight)
    op_norm = OpRMSNorm(norm.weight, norm.eps)
    assert op_norm.weight is norm.weight
    torch.testing.assert_close(op_norm(hidden), norm(hidden), **tolerance)
    torch.testing.assert_close(OpRotary()(qk, cos, sin), layers.Rotary()(qk, cos, sin), **tolerance)
    torch.testing.assert_close(OpSiluAndMul()(gate_up), layers.SiluAndMul()(gate_up), **tolerance)
    gemma_norm = layers.OffsetRMSNorm(576, 1e-6).to(dtype)      # Gemma's: times (1 + weight)
    gemma_norm.weight.copy_(weight - 1)
    op_gemma_norm = OpOffsetRMSNorm(gemma_norm.weight, gemma_norm.eps)
    got = op_gemma_norm(hidden)
    assert got.dtype == dtype and got.is_contiguous()
    torch.testing.assert_close(got, gemma_norm(hidden), **tolerance)
    head_norm = layers.OffsetRMSNorm(64, 1e-6).to(dtype)         # on a strided view, as q/k norms are
    head_norm.weight.copy_(weight[:64] - 1)
    torch.testing.assert_close(OpOffsetRMSNorm(head_norm.weight, 1e-6)(qk[:, :15]), head_norm(qk[:, :15]), **tolerance)
    got = OpGeluTanhAndMul()(gate_up)
    assert got.dtype == dtype and got.shape == (gate_up.shape[0], gate_up.shape[1] // 2)
    torch.testing.assert_close(got, layers.GeluTanhAndMul()(gate_up), **tolerance)


@needs_library
@pytest.mark.parametrize("dtype", DTYPES)
def test_compiled_calls_compute_the_eager_bits_where_inductors_loops_do_not(dtype):
    assert glue_ops_available()
    qk, cos, sin, hidden, weight, gate_up = inputs(dtype)
    residual = torch.randn_like(hidden)

    def layer_glue(ops, hidden, residual, qk, gate_up):
        x = hidden + residual
        return ops.rms_norm(x, weight, 1e-5), ops.rotary(qk, cos, sin), ops.silu_mul(gate_up)

    eager = layer_glue(torch.ops.duoserve, hidden, residual, qk, gate_up)
    compiled = torch.compile(layer_glue, dynamic=True)(torch.ops.duoserve, hidden, residual, qk, gate_up)
    assert all(torch.equal(c, e) for c, e in zip(compiled, eager))
    # the same functions traced into: Inductor's loops move the last bits of at least one
    traced = torch.compile(layer_glue, dynamic=True)(ModelFunctions, hidden, residual, qk, gate_up)
    assert not all(torch.equal(t, e) for t, e in zip(traced, eager))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_route_is_softmax_top_k_and_never_leaves_the_experts(dtype):
    """duoserve::moe_route (glue.c's routing, the C++ decode step's too) against torch's softmax
    and topk: the same experts, weights within rounding, renormalized or not; NaN logits (a broken
    model) still name experts that exist."""
    from duoserve.model.moe import TopKRouting

    logits = torch.randn(32, 8, generator=torch.Generator().manual_seed(3)).to(dtype)
    for renormalize in (True, False):
        chosen, weights = torch.ops.duoserve.moe_route(logits, 2, renormalize)
        want_chosen, want_weights = TopKRouting(2, renormalize)(logits)
        assert torch.equal(chosen, want_chosen)
        assert weights.dtype == dtype and torch.allclose(weights.float(), want_weights.float(), rtol=1e-2, atol=1e-6)
    chosen, _ = torch.ops.duoserve.moe_route(torch.full((2, 8), float("nan"), dtype=dtype), 3, True)
    assert ((chosen >= 0) & (chosen < 8)).all() and all(len(set(row.tolist())) == 3 for row in chosen)
