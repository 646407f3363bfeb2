"""The C++ decode step computed from GGUF blocks, against the eager step.

Tiny GGUF files (Llama; Qwen2 with its q/k/v bias; Gemma 2 and 3 and the mixtures of experts,
from blocks and dense) of
several block types, a Qwen2 whose fused
projections mix block types (as Qwen2.5-Coder's Q5_0/Q8_0/Q4_K/Q6_K file does), both modes,
float32 and bfloat16: for the prompts' step, then steps of decodes and steps of sequences checking
guesses (several rows each), ``FusedDecodeStep`` and the eager
model (the ops a compiled step calls too) give the same hidden states, caches and greedy tokens,
bit for bit: the step's norms, rotary and SiLU are the ops' own functions (csrc/glue.c), and its
projections are gguf_linear.c's team entries, whose bits ``tests/kernels/test_gguf.py`` holds
equal to the ops'.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from duoserve.config import ModelConfig
from duoserve.kernels.dense import packed_linear_supported
from duoserve.kernels.linear import CPULinear, GGUFEmbedding, GGUFLinear
from duoserve.kernels.ops import StepContext, decode_step_available, register_context
from duoserve.model.attention import AttentionMetadata
from duoserve.model.gguf_loader import GGUFBlocks
from duoserve.worker.backends import load_model, use_cpu_kernels
from duoserve.worker.fused_decode import FusedDecodeStep, why_not
from tests.kernels.test_gguf import random_blocks
from tests.model.test_gguf import write_gguf

pytestmark = pytest.mark.skipif(not decode_step_available(), reason="no C++ compiler: csrc/cpu_ops.cpp not built")

PROMPTS = [[3, 141, 59, 26, 53], [97, 93], [238, 46, 26, 43, 38, 32, 79, 50, 28]]
BLOCK_SIZE = 4


def _load(path, dtype: str, mode: str | None):
    """The model as the runner prepares it: its norms, rotary and SiLU the glue ops, its attention C's
    (mode None: a dense checkpoint's packed weights)."""
    gguf = {} if mode is None else {"quantization": "gguf", "gguf_mode": mode}
    model = load_model(ModelConfig(model=str(path), dtype=dtype, **gguf)).model
    use_cpu_kernels(model, model.dtype)
    return model


def _blocks(type_name: str, rows: int, cols: int, seed: int) -> GGUFBlocks:
    raw, _ = random_blocks(type_name, rows, cols, seed=seed)
    return GGUFBlocks(torch.from_numpy(np.ascontiguousarray(raw)), type_name, rows, cols)


def mix_block_types(model, mode: str) -> None:
    """Each layer's projections rebuilt from blocks of mixed types: q, k, v of three types, gate
    and up of two, o and down of one each; the embedding in K-quant blocks."""
    arch = model.arch
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    hidden, inter = arch.hidden_size, arch.intermediate_size
    model.embed = GGUFEmbedding(_blocks("Q4_K", arch.vocab_size, hidden, 7), model.dtype)
    for i, layer in enumerate(model.layers):
        seed = 100 * i
        qkv = [_blocks("Q4_K", q, hidden, seed), _blocks("Q8_0", kv, hidden, seed + 1), _blocks("Q6_K", kv, hidden, seed + 2)]
        layer.qkv = GGUFLinear(qkv, layer.qkv.bias, mode)
        layer.o_proj = GGUFLinear([_blocks("Q5_1", hidden, q, seed + 3)], None, mode)
        layer.gate_up = GGUFLinear([_blocks("Q5_0", inter, hidden, seed + 4), _blocks("Q4_K", inter, hidden, seed + 5)],
                                   None, mode)
        layer.down = GGUFLinear([_blocks("Q6_K", hidden, inter, seed + 6)], None, mode)


def load_tiny(tiny_dir, tmp_path, kind: str, source: str, dtype: str):
    """The tiny checkpoint of ``kind`` as the runner prepares it, from ``source`` (a GGUF block type
    in fast mode, or "dense": its packed weights); None where its dense weights (all of them, or a
    mixture's float32 router) cannot be packed here (no AVX-512), after checking that the step
    declines the model, saying why."""
    if source != "dense":
        path = tmp_path / f"tiny-{kind}.gguf"
        write_gguf(tiny_dir(kind=kind), path, source)
        model = _load(path, dtype, "fast")
        routed = any(getattr(layer, "moe", None) is not None for layer in model.layers)
        if not (routed and not packed_linear_supported(model.dtype)):
            return model
        # a mixture's router stays float32 in the file (as llama.cpp keeps it): dense, so it
        # needs a packed copy, which this CPU cannot make (no AVX-512): decodes run eagerly
    else:
        model = _load(tiny_dir(kind=kind), dtype, None)
    if not packed_linear_supported(model.dtype):   # no packed copy to read: decodes run eagerly
        assert why_not(model, []) == ("a linear layer neither packed in the model's dtype nor in GGUF "
                                      "blocks (at most 4 block types)")
        return None
    return model


# the new tokens of each sequence in a step, by turns: decodes alone, then a step like a speculating
# batch's (one sequence decoding, two checking guesses: 4 and 2 rows over their causal contexts)
STEP_SHAPES = [(1, 1, 1), (1, 4, 2)]


def _same_through_both(model, fused, caches, ids, positions, meta, what: str) -> torch.Tensor:
    """The step through the eager model and through ``fused`` from the same caches: the same hidden
    states and caches, bit for bit. Returns the hidden states."""
    assert fused.serves(meta, len(ids)), what
    before = [(k.clone(), v.clone()) for k, v in caches]
    want = model(ids, positions, caches, meta)
    eager_caches = [(k.clone(), v.clone()) for k, v in caches]
    for (k, v), (k0, v0) in zip(caches, before):
        k.copy_(k0)
        v.copy_(v0)
    got = fused(ids, positions, meta)
    assert got.dtype == model.dtype and torch.equal(got, want), (what, _relative(got, want))
    for (k, v), (k1, v1) in zip(caches, eager_caches):
        assert torch.equal(k, k1) and torch.equal(v, v1), f"{what}: caches differ"
    return want


def assert_decodes_equal(model, steps: int = 4) -> list[list[int]]:
    """The prompts' step, then `steps` steps shaped by turns as STEP_SHAPES (the extra rows a
    sequence's guesses: its greedy token, then tokens made up), each through both paths from the same
    caches: the same hidden states, caches and greedy tokens, bit for bit. Returns each step's greedy
    token of every sequence."""
    arch, dtype = model.arch, model.dtype
    longest = max(map(len, PROMPTS)) + sum(max(STEP_SHAPES[s % len(STEP_SHAPES)]) for s in range(steps))
    per_seq = -(-longest // BLOCK_SIZE)
    shape = (per_seq * len(PROMPTS), BLOCK_SIZE, arch.num_kv_heads, arch.head_dim)
    caches = [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)) for _ in range(arch.num_layers)]
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(len(PROMPTS))]
    assert why_not(model, caches) is None, why_not(model, caches)
    context = StepContext(caches, [layer.attn for layer in model.layers])
    register_context(context)
    fused = FusedDecodeStep(model, caches, context)
    lens = [len(p) for p in PROMPTS]
    ids = torch.tensor([t for p in PROMPTS for t in p])
    positions = torch.cat([torch.arange(len(p)) for p in PROMPTS])
    meta = AttentionMetadata.build(lens, lens, tables, BLOCK_SIZE)
    hidden = _same_through_both(model, fused, caches, ids, positions, meta, "the prompts")
    tokens = model.compute_logits(hidden[torch.tensor(lens).cumsum(0) - 1]).argmax(-1).tolist()
    generated = [tokens]
    for step in range(steps):
        news = STEP_SHAPES[step % len(STEP_SHAPES)]
        ids = torch.tensor([(t + 7 * j) % arch.vocab_size for t, n in zip(tokens, news) for j in range(n)])
        positions = torch.cat([torch.arange(length, length + n) for length, n in zip(lens, news)])
        lens = [length + n for length, n in zip(lens, news)]
        meta = AttentionMetadata.build(list(news), lens, tables, BLOCK_SIZE)
        hidden = _same_through_both(model, fused, caches, ids, positions, meta, f"step {step}")
        tokens = model.compute_logits(hidden[torch.tensor(news).cumsum(0) - 1]).argmax(-1).tolist()
        generated.append(tokens)
    return generated


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-30)).item()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("mode", ["fast", "exact"])
@pytest.mark.parametrize("type_name", ["Q4_1", "Q8_0", "Q5_0"])
def test_llama_blocks_decode_as_eager(tiny_dir, tmp_path, type_name, mode, dtype):
    path = tmp_path / f"tiny-{type_name}.gguf"
    write_gguf(tiny_dir(kind="llama"), path, type_name)
    model = _load(path, dtype, mode)
    assert isinstance(model.layers[0].qkv, GGUFLinear) and isinstance(model.embed, GGUFEmbedding)
    assert_decodes_equal(model)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("mode", ["fast", "exact"])
def test_qwen2_bias_and_mixed_block_types_decode_as_eager(tiny_dir, tmp_path, mode, dtype):
    """Qwen2's q/k/v bias added after the projection's rounding; fused projections whose parts
    have different block types (K-quants among them: 256 columns); K-quant embedding rows."""
    path = tmp_path / "tiny-qwen2-Q8_0.gguf"
    write_gguf(tiny_dir(kind="qwen2", hidden_size=256, intermediate_size=256), path, "Q8_0")
    model = _load(path, dtype, mode)
    assert model.layers[0].qkv.bias is not None
    assert_decodes_equal(model)
    mix_block_types(model, mode)
    assert [p.type_name for p in model.layers[0].qkv.parts] == ["Q4_K", "Q8_0", "Q6_K"]
    tokens = assert_decodes_equal(model)
    assert len({t for step in tokens for t in step}) > 1, "a degenerate model would prove little"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("source", ["Q8_0", "dense"])
@pytest.mark.parametrize("kind", ["gemma3", "gemma2"])
def test_gemma_decodes_as_eager(tiny_dir, tmp_path, kind, source, dtype):
    """Gemma's differences in the C++ step: four norms a layer, each times (1 + weight), tanh-GELU,
    embedding rows times sqrt(hidden); a local layer with a window of 8 (the contexts here grow
    past it, to 15) and, in Gemma 3, its own rope table and q/k norms; Gemma 2's capped scores."""
    model = load_tiny(tiny_dir, tmp_path, kind, source, dtype)
    if model is None:
        return
    assert isinstance(model.layers[0].qkv, CPULinear if source == "dense" else GGUFLinear)
    arch = model.arch
    assert arch.family == "gemma" and arch.window(0) == 8 and arch.window(1) is None
    assert (arch.attn_logit_softcap is not None) == (kind == "gemma2") and arch.qk_norm == (kind == "gemma3")
    tokens = assert_decodes_equal(model, steps=6)
    assert len({t for step in tokens for t in step}) > 1, "a degenerate model would prove little"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("source", ["Q8_0", "dense"])
@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_mixtures_of_experts_decode_as_eager(tiny_dir, tmp_path, kind, source, dtype):
    """A routed MLP in the C++ step: each row's top 2 of 4 experts (Qwen2-MoE's weights not
    renormalized, and its shared expert behind a sigmoid gate; Qwen3-MoE's q/k norms), each chosen
    expert run once over its rows, the step's experts counted as the eager model counts them."""
    model = load_tiny(tiny_dir, tmp_path, kind, source, dtype)
    if model is None:
        return
    assert isinstance(model.layers[0].moe.experts[0].gate_up, CPULinear if source == "dense" else GGUFLinear)
    arch = model.arch
    assert arch.family == "moe" and arch.num_experts == 4 and arch.experts_per_token == 2
    assert (arch.shared_expert_intermediate_size > 0) == (kind == "qwen2_moe")
    moes = [layer.moe for layer in model.layers]
    counted = [moe.expert_tokens.clone() for moe in moes]
    tokens = assert_decodes_equal(model, steps=5)
    assert len({t for step in tokens for t in step}) > 1, "a degenerate model would prove little"
    # the prompts and 5 steps (3 of 3 rows, 2 of 7), each through both paths: every row's 2 picks counted
    picks = 2 * 2 * (sum(map(len, PROMPTS)) + 3 * 3 + 2 * 7)
    assert all(int((moe.expert_tokens - before).sum()) == picks for moe, before in zip(moes, counted))
    assert all(int((moe.expert_tokens - before).count_nonzero()) > 1 for moe, before in zip(moes, counted))


def test_the_default_model_takes_the_decode_step():
    """The packaged GGUF file (fast mode, the default): every weight is one the step reads."""
    loaded = load_model(ModelConfig())
    assert loaded.quantization == "gguf-fast"
    arch, dtype = loaded.model.arch, loaded.model.dtype
    caches = [(torch.zeros(2, 16, arch.num_kv_heads, arch.head_dim, dtype=dtype),) * 2] * arch.num_layers
    assert why_not(loaded.model, caches) is None
