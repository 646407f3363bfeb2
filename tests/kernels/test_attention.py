"""Paged attention: the C kernels (duoserve.kernels.attention) and the torch reference
(duoserve.model.attention) agree; block layout never matters."""

from __future__ import annotations

import random

import pytest
import torch

from duoserve.kernels import attention as c_attention
from duoserve.kernels.attention import CAttention, c_decode_attention, paged_decode_kernel
from duoserve.kernels.build import load_c_function
from duoserve.kernels.ops import decode_attention_op
from duoserve.model import attention
from duoserve.model.attention import AttentionMetadata, PagedAttention, _decode_attention, kv_head_slots


def _setup(dtype, num_seqs=5, num_heads=8, num_kv_heads=2, head_dim=32, block_size=4, num_blocks=64):
    rng = random.Random(0)
    torch.manual_seed(0)
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim).to(dtype)
    lens = [rng.randint(1, 30) for _ in range(num_seqs)]
    tables = [rng.sample(range(num_blocks), -(-n // block_size)) for n in lens]
    meta = AttentionMetadata.build([1] * num_seqs, lens, tables, block_size)
    q = torch.randn(num_seqs, num_heads, head_dim)
    return q, k_cache, v_cache, meta, lens, tables


def _reference(q, k_cache, v_cache, lens, tables, scale, window=None, cap=None):
    """Plain softmax attention per sequence over its blocks (its last ``window`` keys; scores
    soft-capped by ``cap``), GQA by repetition."""
    outs = []
    group = q.shape[1] // k_cache.shape[2]
    for i, (n, table) in enumerate(zip(lens, tables)):
        first = 0 if window is None else max(0, n - window)
        k = k_cache[table].flatten(0, 1)[first:n].float().repeat_interleave(group, dim=1)  # [n, heads, dim]
        v = v_cache[table].flatten(0, 1)[first:n].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[i], k) * scale
        if cap is not None:
            scores = torch.tanh(scores / cap) * cap
        probs = torch.softmax(scores, dim=-1)
        outs.append(torch.einsum("hn,nhd->hd", probs, v).reshape(-1))
    return torch.stack(outs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_decode_path_matches_reference(dtype):
    q, k_cache, v_cache, meta, lens, tables = _setup(dtype)
    got = _decode_attention(q, k_cache, v_cache, meta, 0.2, kv_head_slots(8, 2))
    assert (got - _reference(q, k_cache, v_cache, lens, tables, 0.2)).abs().max() < 1e-5


@pytest.mark.parametrize("window, cap", [(5, None), (1, None), (None, 0.7), (6, 0.7)])
def test_torch_decode_path_with_a_window_and_soft_cap(window, cap):
    """Contexts of 1-30 keys against windows shorter than most of them: only the last ``window``
    keys are attended; capped scores are capped before the mask (a capped -inf would count)."""
    q, k_cache, v_cache, meta, lens, tables = _setup(torch.float32)
    assert window is None or max(lens) > window
    got = _decode_attention(q, k_cache, v_cache, meta, 0.2, kv_head_slots(8, 2), window, cap)
    want = _reference(q, k_cache, v_cache, lens, tables, 0.2, window, cap)
    assert (got - want).abs().max() < 1e-5
    if window is not None:
        assert (got - _reference(q, k_cache, v_cache, lens, tables, 0.2, None, cap)).abs().max() > 1e-2


@pytest.mark.needs(paged_decode_kernel, reason="no C compiler on this machine")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# head_dim 32: the portable loop; 64: the register path (AVX-512)
@pytest.mark.parametrize("heads", [(8, 2, 32), (8, 2, 64)])
@pytest.mark.parametrize("window, cap", [(3, None), (8, None), (1, None), (None, 0.7), (6, 0.7)])
def test_c_attention_windows_and_caps_in_the_c_kernel(monkeypatch, dtype, heads, window, cap):
    """A layer with a sliding window or soft-capped scores runs in the C kernel like any other
    (the torch reference is never called): each row sees its last ``window`` keys, a window that
    starts inside a block included (window 3 of blocks of 4), and its scores capped."""
    num_heads, num_kv_heads, head_dim = heads
    q, k_cache, v_cache, meta, lens, tables = _setup(dtype, num_heads=num_heads, num_kv_heads=num_kv_heads,
                                                     head_dim=head_dim)
    assert window is None or max(lens) > window
    layer = CAttention(PagedAttention(num_heads, num_kv_heads, head_dim, scale=0.2, window=window, cap=cap))
    monkeypatch.setattr(layer, "reference", None)
    k = v = torch.zeros(len(lens), num_kv_heads, head_dim)
    slots = meta.slot_mapping
    k_cache.view(-1, num_kv_heads, head_dim)[slots] = 0.0  # what the step writes: the new keys and values
    v_cache.view(-1, num_kv_heads, head_dim)[slots] = 0.0
    got = layer(q, k, v, (k_cache, v_cache), meta)
    want = _reference(q, k_cache, v_cache, lens, tables, 0.2, window, cap)
    assert (got - want).abs().max() < 1e-5
    assert (got - _reference(q, k_cache, v_cache, lens, tables, 0.2)).abs().max() > 1e-2, "the window or cap counted"


@pytest.mark.needs(paged_decode_kernel, reason="no C compiler on this machine")
@pytest.mark.parametrize("window, cap", [(5, None), (40, None), (None, 0.5)])
def test_c_prefill_rows_with_a_window_or_cap_match_the_reference(window, cap):
    """A prompt chunk's rows (which the tiled prefill kernel takes when unwindowed and uncapped) with
    a window shorter than their contexts, one longer than all of them, or a cap: each row as the
    reference computes it over its own causal context."""
    torch.manual_seed(1)
    num_blocks, block_size, chunk = 16, 4, 30
    k_cache = torch.randn(num_blocks, block_size, 2, 64)
    v_cache = torch.randn(num_blocks, block_size, 2, 64)
    table = list(range(num_blocks))[::-1][:8]
    lens = list(range(1, chunk + 1))
    q = torch.randn(chunk, 8, 64)
    got = c_decode_attention(q, k_cache, v_cache, torch.tensor([table] * chunk), torch.tensor(lens), 0.2, window, cap)
    want = _reference(q, k_cache, v_cache, lens, [table] * chunk, 0.2, window, cap)
    assert (got - want).abs().max() < 1e-5


@pytest.mark.needs(paged_decode_kernel, reason="no C compiler on this machine")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_seqs", [1, 3, 9])  # work split by (sequence, KV head) and by sequence
# head_dim 32: the portable loop; 64 and 128: the register path (AVX-512), several group sizes
@pytest.mark.parametrize("heads", [(8, 2, 32), (9, 3, 64), (8, 2, 128), (8, 1, 64)])
def test_c_decode_kernel_matches_reference(dtype, num_seqs, heads):
    torch.set_num_threads(2)
    num_heads, num_kv_heads, head_dim = heads
    q, k_cache, v_cache, meta, lens, tables = _setup(dtype, num_seqs=num_seqs, num_heads=num_heads,
                                                     num_kv_heads=num_kv_heads, head_dim=head_dim)
    got = c_decode_attention(q, k_cache, v_cache, meta.decode_block_tables, meta.decode_seq_lens, 0.2)
    assert got is not None
    assert (got - _reference(q, k_cache, v_cache, lens, tables, 0.2)).abs().max() < 1e-5


@pytest.mark.needs(decode_attention_op, reason="no C++ compiler on this machine")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
def test_decode_step_op_writes_and_attends_as_the_python_path(monkeypatch, dtype, q_dtype):
    """A decode step's attention in one C++ call (duoserve::decode_attention) leaves the caches and
    returns the output exactly as the Python path (the KV write, then the C kernel through ctypes)."""
    q, k_cache, v_cache, meta, lens, tables = _setup(dtype, num_heads=9, num_kv_heads=3, head_dim=64)
    q = q.to(q_dtype)
    k, v = torch.randn(5, 3, 64).to(q_dtype), torch.randn(5, 3, 64).to(q_dtype)
    caches = [(k_cache.clone(), v_cache.clone()) for _ in range(2)]
    layer = CAttention(PagedAttention(9, 3, 64))   # scale 64 ** -0.5 = 0.125
    by_op = layer(q, k, v, caches[0], meta)
    monkeypatch.setattr(c_attention, "decode_attention_op", lambda: None)
    by_python = layer(q, k, v, caches[1], meta)
    assert by_op.dtype == q_dtype and torch.equal(by_op, by_python)
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])
    slot = int(meta.slot_mapping[0])   # the new keys really were written
    assert torch.equal(caches[0][0].view(-1, 3, 64)[slot], k[0].to(dtype))


@pytest.mark.needs(decode_attention_op, reason="no C++ compiler on this machine")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_step_op_writes_rows_of_a_strided_view_and_refuses_a_slot_outside(dtype):
    """Keys and values as a compiled graph passes them (views into the fused q/k/v rows) land in
    their slots unchanged; a slot past the cache is an error and nothing is written."""
    q, k_cache, v_cache, meta, lens, tables = _setup(dtype, num_heads=9, num_kv_heads=3, head_dim=64)
    qkv = torch.randn(5, 15, 64).to(dtype)
    k, v = qkv[:, 9:12], qkv[:, 12:15]
    op = decode_attention_op()
    op(q, k, v, k_cache, v_cache, meta.slot_mapping, meta.decode_block_tables, meta.decode_seq_lens, 0.125, 0, 0.0)
    for i, slot in enumerate(meta.slot_mapping.tolist()):
        assert torch.equal(k_cache.view(-1, 3, 64)[slot], k[i]) and torch.equal(v_cache.view(-1, 3, 64)[slot], v[i])
    before = k_cache.clone()
    outside = meta.slot_mapping.clone()
    outside[2] = k_cache.numel() // (3 * 64)
    with pytest.raises(RuntimeError, match=f"slot {int(outside[2])} outside the cache's {int(outside[2])}"):
        op(q, k, v, k_cache, v_cache, outside, meta.decode_block_tables, meta.decode_seq_lens, 0.125, 0, 0.0)
    assert torch.equal(k_cache, before), "no row is written when one slot is wrong"
    with pytest.raises(RuntimeError, match="a cache pair, a scale, a window and a cap for every layer"):
        torch.ops.duoserve.attention_step(10**6, [k_cache], [], meta.slot_mapping, meta.decode_block_tables,
                                          meta.decode_seq_lens, [0.125], [0], [0.0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cached", [0, 13])  # a chunk that is the whole context, and one after a cached prefix
def test_prefill_paths_agree_with_reference(monkeypatch, dtype, cached):
    """The three prefill paths (the C kernel query by query; without it, grouped matmuls for short
    chunks and SDPA for long ones) against plain causal softmax attention, GQA by repetition."""
    torch.manual_seed(1)
    num_heads, num_kv_heads, head_dim, block_size, chunk = 8, 2, 32, 4, 11
    seq_len = cached + chunk
    table = list(range(-(-seq_len // block_size)))
    k_all = torch.randn(seq_len, num_kv_heads, head_dim).to(dtype)
    v_all = torch.randn(seq_len, num_kv_heads, head_dim).to(dtype)
    shape = (len(table), block_size, num_kv_heads, head_dim)
    k_cache = torch.zeros(shape, dtype=dtype).view(-1, num_kv_heads, head_dim)
    v_cache = torch.zeros(shape, dtype=dtype).view(-1, num_kv_heads, head_dim)
    k_cache[:seq_len], v_cache[:seq_len] = k_all, v_all
    k_cache, v_cache = k_cache.view(shape), v_cache.view(shape)
    q = torch.randn(chunk, num_heads, head_dim).to(dtype)
    meta = AttentionMetadata.build([chunk], [seq_len], [table], block_size)
    seq = meta.prefills[0]
    k_new, v_new = k_all[cached:], v_all[cached:]
    group = num_heads // num_kv_heads
    scores = torch.einsum("qhd,khd->hqk", q.float(), k_all.float().repeat_interleave(group, 1)) * 0.2
    visible = torch.arange(seq_len)[None, :] <= torch.arange(chunk)[:, None] + cached
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), -1)
    want = torch.einsum("hqk,khd->qhd", probs, v_all.float().repeat_interleave(group, 1)).reshape(chunk, -1)
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    grouped = attention._prefill_attention(q, k_new, v_new, k_cache, v_cache, seq, 0.2)
    monkeypatch.setattr(attention, "_GROUPED_MAX_SCORES", 0)
    sdpa = attention._prefill_attention(q, k_new, v_new, k_cache, v_cache, seq, 0.2)
    assert (grouped.float() - want).abs().max() < tolerance
    assert (sdpa.float() - want).abs().max() < tolerance
    if paged_decode_kernel() is not None:  # the C kernel, query by query
        by_kernel = c_decode_attention(q, k_cache, v_cache, seq.token_block_tables, seq.token_seq_lens, 0.2)
        assert (by_kernel.float() - want).abs().max() < 1e-5


@pytest.mark.needs(paged_decode_kernel, reason="no C compiler on this machine")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_c_backend_runs_a_mixed_step_as_the_torch_reference(dtype):
    """Decodes and two prompt chunks (one after a cached prefix) in one step: the C backend
    writes the same caches and attends as the module it replaces."""
    torch.manual_seed(4)
    num_heads, num_kv_heads, head_dim, block_size = 8, 2, 64, 4
    query_lens, seq_lens = [1, 1, 6, 5], [9, 3, 6, 12]
    tables = [[0, 1, 2], [3], [4, 5], [6, 7, 8]]
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, block_size)
    num_tokens = sum(query_lens)
    q = torch.randn(num_tokens, num_heads, head_dim).to(dtype)
    k, v = (torch.randn(num_tokens, num_kv_heads, head_dim).to(dtype) for _ in range(2))
    shape = (12, block_size, num_kv_heads, head_dim)
    cache = (torch.randn(shape).to(dtype), torch.randn(shape).to(dtype))
    caches = [(cache[0].clone(), cache[1].clone()) for _ in range(2)]
    reference = PagedAttention(num_heads, num_kv_heads, head_dim)
    want = reference(q, k, v, caches[0], meta)
    got = CAttention(reference)(q, k, v, caches[1], meta)
    assert got.dtype == dtype and got.shape == want.shape
    assert (got.float() - want.float()).abs().max() < (1e-5 if dtype == torch.float32 else 3e-2)
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])


def _rows(spec, block_size, num_blocks, rng):
    """Per-row tables and lengths for runs given as (tokens, keys before the first): each run a
    sequence of its own blocks, its token i seeing keys + i + 1 keys, as token_contexts() gives."""
    tables, lens = [], []
    for count, before in spec:
        blocks = rng.sample(range(num_blocks), -(-(before + count) // block_size))
        for i in range(count):
            tables.append(blocks)
            lens.append(before + i + 1)
    width = max(map(len, tables))
    return torch.tensor([t + [0] * (width - len(t)) for t in tables]), torch.tensor(lens), tables


@pytest.fixture
def tiles():
    """The tiled prompt kernel switched on for one test (it is off by default: paged_prefill.c)."""
    import ctypes

    switch = load_c_function("paged_decode", "paged_set_tiled_prefill", (ctypes.c_int,), restype=None)
    switch(1)
    yield
    switch(0)


@pytest.mark.needs(paged_decode_kernel, reason="no C compiler on this machine")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# head_dim 64 and 128 tile (AVX-512); 32 takes the decode kernel throughout; several groups and block sizes
@pytest.mark.parametrize("shape", [(9, 3, 64, 16), (8, 2, 128, 16), (4, 4, 64, 8), (12, 1, 64, 32), (8, 2, 32, 16)])
def test_c_kernel_runs_of_prompt_tokens_match_reference(dtype, shape, tiles):
    """Rows of a prompt chunk (a run: one table, lengths growing by one) go to the tiled kernel,
    others to the decode kernel, in one call: all match plain softmax attention. Tolerance: 1e-5
    in float32; in bfloat16 2e-2, the probabilities being rounded to bf16 for the dot products
    (2^-9 relative) against values of magnitude up to ~4."""
    torch.set_num_threads(2)
    num_heads, num_kv_heads, head_dim, block_size = shape
    rng = random.Random(2)
    torch.manual_seed(2)
    k_cache = torch.randn(96, block_size, num_kv_heads, head_dim).to(dtype)
    v_cache = torch.randn(96, block_size, num_kv_heads, head_dim).to(dtype)
    # decodes, a whole prompt, a chunk after 50 cached keys, a run of 2 (decode kernel), 17 rows
    # (a tile of 16 and one row), one of 3 starting at the first key
    spec = [(1, 37), (1, 4), (40, 0), (29, 50), (2, 9), (17, 70), (3, 0), (1, 100)]
    tables, lens, blocks = _rows(spec, block_size, 96, rng)
    q = torch.randn(len(lens), num_heads, head_dim).to(dtype).float()
    got = c_decode_attention(q, k_cache, v_cache, tables, lens, 0.125)
    want = _reference(q, k_cache, v_cache, lens.tolist(), blocks, 0.125)
    assert (got - want).abs().max() < (1e-5 if dtype == torch.float32 else 2e-2)


@pytest.mark.needs(paged_decode_kernel, reason="no C compiler on this machine")
def test_rows_group_into_runs_only_over_one_table():
    """paged_find_runs: consecutive rows whose lengths grow by one and whose tables agree on the
    blocks the shorter row reads are one run (3 rows or more); anything else is a single row."""
    import ctypes

    P, I = ctypes.c_void_p, ctypes.c_int
    find = load_c_function("paged_decode", "paged_find_runs", (P, P, I, I, I, P, P, P, P))
    tables = torch.tensor([[7, 0, 0], [3, 4, 0], [3, 4, 0], [3, 4, 0], [3, 4, 9], [3, 4, 9],  # rows 0-5
                           [5, 0, 0], [5, 0, 0],                                             # a run of 2
                           [1, 2, 0], [1, 6, 0], [1, 6, 0], [1, 6, 0],                       # block 2 differs
                           [8, 0, 0], [8, 0, 0], [8, 0, 0]])                                 # lengths 3, 4, 4
    lens = torch.tensor([5, 6, 7, 8, 9, 10, 2, 3, 7, 8, 9, 10, 3, 4, 4])
    firsts, counts, singles = (torch.zeros(15, dtype=torch.int32) for _ in range(3))
    num_singles = ctypes.c_int()
    runs = find(tables.data_ptr(), lens.data_ptr(), 15, 3, 4, firsts.data_ptr(), counts.data_ptr(),
                singles.data_ptr(), ctypes.byref(num_singles))
    # rows 0..5: lengths 5..10 over [7] then [3, 4, ...]: row 0 reads block 7, row 1 block 3
    assert runs == 2 and firsts[:2].tolist() == [1, 9] and counts[:2].tolist() == [5, 3]
    assert singles[:num_singles.value].tolist() == [0, 6, 7, 8, 12, 13, 14]


@pytest.mark.needs(paged_decode_kernel, reason="no C compiler on this machine")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_c_kernel_run_over_a_long_context_matches_reference(dtype, tiles):
    """A chunk of 40 tokens after 1,990 cached keys: the online softmax carried over 127 blocks
    of sixteen keys, scores far apart (q scaled up), still plain softmax attention."""
    torch.set_num_threads(2)
    rng = random.Random(3)
    torch.manual_seed(3)
    k_cache = torch.randn(160, 16, 3, 64).to(dtype)
    v_cache = torch.randn(160, 16, 3, 64).to(dtype)
    tables, lens, blocks = _rows([(40, 1990)], 16, 160, rng)
    q = (4 * torch.randn(len(lens), 9, 64)).to(dtype).float()
    got = c_decode_attention(q, k_cache, v_cache, tables, lens, 0.125)
    want = _reference(q, k_cache, v_cache, lens.tolist(), blocks, 0.125)
    assert (got - want).abs().max() < (1e-5 if dtype == torch.float32 else 2e-2)


@pytest.mark.needs(paged_decode_kernel, reason="no C compiler on this machine")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# (heads, KV heads, head_dim, block size, window, cap): groups of 1 to 8 query heads a KV head, both
# head sizes of the decode kernel's register path, a window some rows outgrow, a soft cap; 32
# takes its portable loop
@pytest.mark.parametrize("shape", [(8, 2, 64, 16, 0, 0.0), (9, 3, 64, 16, 0, 0.0), (14, 2, 64, 16, 0, 0.0),
                                   (4, 4, 64, 8, 0, 0.0), (8, 1, 64, 32, 0, 0.0), (8, 2, 128, 16, 0, 0.0),
                                   (4, 4, 128, 16, 0, 0.0), (4, 1, 64, 16, 48, 0.0), (8, 2, 64, 16, 0, 3.0),
                                   (8, 2, 32, 16, 0, 0.0)])
def test_by_default_a_row_attends_with_the_same_bits_in_a_run_or_alone(dtype, shape):
    """Tiles off (the default): a prompt chunk's rows compute what each computes alone, as a
    decode row, bit for bit, so a token's attention does not depend on its chunk or batch; and
    they match plain softmax attention."""
    torch.set_num_threads(2)
    num_heads, num_kv_heads, head_dim, block_size, window, cap = shape
    rng = random.Random(4)
    torch.manual_seed(4)
    k_cache = torch.randn(64, block_size, num_kv_heads, head_dim).to(dtype)
    v_cache = torch.randn(64, block_size, num_kv_heads, head_dim).to(dtype)
    # a chunk after 30 cached keys, a whole prompt, a decode, a run of 3 from the first key
    tables, lens, blocks = _rows([(40, 30), (5, 0), (1, 60), (3, 0)], block_size, 64, rng)
    q = torch.randn(len(lens), num_heads, head_dim).to(dtype).float()
    together = c_decode_attention(q, k_cache, v_cache, tables, lens, 0.125, window, cap)
    one_by_one = torch.cat([c_decode_attention(q[i:i + 1], k_cache, v_cache, tables[i:i + 1], lens[i:i + 1], 0.125,
                                               window, cap) for i in range(len(lens))])
    assert torch.equal(together, one_by_one)
    want = _reference(q, k_cache, v_cache, lens.tolist(), blocks, 0.125, window or None, cap or None)
    assert (together - want).abs().max() < 1e-5
