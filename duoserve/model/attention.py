"""Attention over a paged KV cache: the torch reference, for CPU and CUDA.

The KV cache of one layer is two tensors ``[num_blocks, block_size, num_kv_heads,
head_dim]``. A batch is a flat run of tokens; ``AttentionMetadata`` says where each
token's keys and values go (``slot_mapping``: block * block_size + offset) and, per
sequence, which blocks hold its context. Sequences decoding one token come first
in the batch, then sequences with several new tokens (prefill chunks)::

    tokens:  d0 d1 d2 | p0 p0 p0 p0 | p1 p1
             decodes    prefill chunk  prefill chunk

Decodes attend together: their context slots are gathered once per layer with one
``index_select`` (the slot list is built once per step), then two batched matmuls do
all heads at once (see ``_decode_attention``). A prefill chunk attends with two grouped
matmuls, or ``scaled_dot_product_attention`` when long. ``PagedAttention`` is a module so
that the runner can swap in a faster backend at the edge (the C kernels read each token as
a row over its own causal context: ``AttentionMetadata`` also describes the step that way).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(slots=True)
class PrefillSeq:
    query_start: int        # index of the chunk's first token in the flat batch
    query_len: int          # tokens computed this step
    seq_len: int            # tokens in the cache after this step (prefix + chunk)
    block_table: torch.Tensor  # [num_blocks_of_seq] block ids, long
    mask: torch.Tensor | None  # [query_len, seq_len] bool, None when causal over itself
    # each query token as a decode over its causal context (the C kernel's inputs; built once a
    # step, read by every layer): the block table per token, and how many tokens each one sees
    token_block_tables: torch.Tensor  # [query_len, num_blocks_of_seq] long
    token_seq_lens: torch.Tensor      # [query_len] long: seq_len - query_len + 1 ... seq_len
    _windowed: dict = field(default_factory=dict)  # window -> its mask (see visible), made on first use

    def visible(self, window: int | None) -> torch.Tensor | None:
        """[query_len, seq_len] bool: which keys each query token sees, causal and, with a sliding
        ``window``, only the last ``window`` positions up to its own (Hugging Face's rule: key j is
        seen from position i when i - window < j <= i); None when that is plain causal attention over
        the chunk itself."""
        if window is None or window >= self.seq_len:
            return self.mask
        if window not in self._windowed:
            rows = torch.arange(self.query_len, device=self.block_table.device)[:, None] + (self.seq_len - self.query_len)
            keys = torch.arange(self.seq_len, device=self.block_table.device)[None, :]
            self._windowed[window] = (keys <= rows) & (keys > rows - window)
        return self._windowed[window]


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor          # [num_tokens] long: where each token's K/V is written
    num_decode_tokens: int              # the first tokens, one per decoding sequence
    decode_block_tables: torch.Tensor | None  # [num_decodes, max_blocks] long (for the C kernel)
    decode_seq_lens: torch.Tensor | None      # [num_decodes] long
    prefills: list[PrefillSeq]
    block_size: int
    _decode_gather: dict = field(default_factory=dict)   # window -> (slots, mask): see decode_gather
    # LoRA rows (worker/lora.py): each token's adapter (-1: none) and the adapters' table addresses
    lora: tuple[torch.Tensor, torch.Tensor] | None = None
    _longest: int | None = None                          # see longest_context

    def longest_context(self) -> int:
        """The most keys any token of the step attends over (a layer with a sliding window no
        longer than it attends exactly like one without)."""
        if self._longest is None:
            decodes = int(self.decode_seq_lens.max()) if self.num_decode_tokens else 0
            self._longest = max([decodes, *(seq.seq_len for seq in self.prefills)])
        return self._longest

    def token_contexts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every token of the step as a row decoding over its own causal context, for the C
        kernel in one call: its block table [num_tokens, max_blocks] (zero-padded) and how many
        tokens it sees [num_tokens] (a prompt token: its position + 1; its chunk's keys and values
        are all written before any row attends)."""
        decodes = [(self.decode_block_tables, self.decode_seq_lens)] if self.num_decode_tokens else []
        parts = decodes + [(seq.token_block_tables, seq.token_seq_lens) for seq in self.prefills]
        if len(parts) == 1:
            return parts[0]
        width = max(tables.shape[1] for tables, _ in parts)
        tables = [t if t.shape[1] == width else F.pad(t, (0, width - t.shape[1])) for t, _ in parts]
        return torch.cat(tables), torch.cat([lens for _, lens in parts])

    def decode_gather(self, window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """For the torch decode path (no C kernel): each decode's context slots [num_decodes * ctx]
        (long) and an additive mask [num_decodes, 1, ctx] (float32, -inf past its length and, with
        a sliding ``window``, before its last ``window`` positions); made on first use, once a step
        and window (the C kernels read the tables and lengths themselves)."""
        if window not in self._decode_gather:
            tables, lens, device = self.decode_block_tables, self.decode_seq_lens, self.slot_mapping.device
            offsets = torch.arange(self.block_size, device=device)
            slots = (tables[:, :, None] * self.block_size + offsets).reshape(-1)
            span = torch.arange(tables.shape[1] * self.block_size, device=device)
            mask = torch.zeros(len(lens), span.numel(), device=device)
            hidden = span[None, :] >= lens[:, None]
            if window is not None:
                hidden |= span[None, :] < lens[:, None] - window
            mask.masked_fill_(hidden, float("-inf"))  # [num_decodes, ctx]
            self._decode_gather[window] = (slots, mask[:, None, :])
        return self._decode_gather[window]

    @staticmethod
    def build(
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> "AttentionMetadata":
        """Describe one step. Sequences with ``query_len == 1`` must come first."""
        slots: list[int] = []
        for query_len, seq_len, table in zip(query_lens, seq_lens, block_tables):
            for pos in range(seq_len - query_len, seq_len):
                slots.append(table[pos // block_size] * block_size + pos % block_size)
        num_decodes = 0
        while num_decodes < len(query_lens) and query_lens[num_decodes] == 1:
            num_decodes += 1
        tables = lens = None
        if num_decodes:
            max_blocks = max(len(t) for t in block_tables[:num_decodes])
            padded = [t + [0] * (max_blocks - len(t)) for t in block_tables[:num_decodes]]
            tables = torch.tensor(padded, dtype=torch.long, device=device)  # [num_decodes, max_blocks]
            lens = torch.tensor(seq_lens[:num_decodes], device=device)
        prefills = []
        start = num_decodes
        for i in range(num_decodes, len(query_lens)):
            query_len, seq_len = query_lens[i], seq_lens[i]
            num_blocks = (seq_len + block_size - 1) // block_size
            table = torch.tensor(block_tables[i][:num_blocks], dtype=torch.long, device=device)
            mask = None
            if seq_len != query_len:
                rows = torch.arange(query_len, device=device)[:, None] + (seq_len - query_len)
                mask = torch.arange(seq_len, device=device)[None, :] <= rows  # [query_len, seq_len]
            token_tables = table[None, :].expand(query_len, -1).contiguous()
            token_lens = torch.arange(seq_len - query_len + 1, seq_len + 1, device=device)
            prefills.append(PrefillSeq(start, query_len, seq_len, table, mask, token_tables, token_lens))
            start += query_len
        return AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
            num_decode_tokens=num_decodes,
            decode_block_tables=tables,
            decode_seq_lens=lens,
            prefills=prefills,
            block_size=block_size,
        )


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k, v: [num_tokens, num_kv_heads, head_dim] into the caches at ``slot_mapping``."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def soft_cap(scores: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap * tanh(scores / cap) (Gemma 2's attention-logit soft-capping), before any mask."""
    return scores if cap is None else torch.tanh(scores / cap) * cap


def _decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      meta: AttentionMetadata, scale: float, head_slot: torch.Tensor,
                      window: int | None = None, cap: float | None = None) -> torch.Tensor:
    """One query token per sequence against its gathered context.

    Keys stay [num_decodes, ctx, num_kv_heads * head_dim] as gathered; each query head is
    placed in its KV head's slot of a zero vector of that width, so one batched matmul
    scores every head against its own KV head (the zeros cancel the others). This
    spends num_kv_heads times the (tiny) FLOPs to avoid copying K and V per KV head.
    """
    num_decodes, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    width = num_kv_heads * head_dim
    decode_slots, decode_mask = meta.decode_gather(window)
    keys = k_cache.view(-1, width).index_select(0, decode_slots).view(num_decodes, -1, width)
    values = v_cache.view(-1, width).index_select(0, decode_slots).view(num_decodes, -1, width)
    keys, values = keys.to(q.dtype), values.to(q.dtype)  # [num_decodes, ctx, width]
    slot = head_slot.to(q.dtype)[None, :, :, None]  # [1, num_heads, num_kv_heads, 1]: 1 at each head's KV head
    spread = (q[:, :, None, :] * slot).view(num_decodes, num_heads, width)  # zeros outside the head's slot
    if cap is None:
        scores = torch.baddbmm(decode_mask.to(q.dtype), spread, keys.transpose(1, 2),
                               alpha=scale)  # [num_decodes, num_heads, ctx]
    else:  # capped before the mask: a capped -inf would be -cap
        scores = soft_cap(torch.bmm(spread, keys.transpose(1, 2)) * scale, cap) + decode_mask.to(q.dtype)
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    out = torch.bmm(probs, values).view(num_decodes, num_heads, num_kv_heads, head_dim)
    return (out * slot).sum(dim=2).view(num_decodes, num_heads * head_dim)


def _prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       k_cache: torch.Tensor, v_cache: torch.Tensor,
                       seq: PrefillSeq, scale: float, window: int | None = None, cap: float | None = None) -> torch.Tensor:
    query_len, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    mask = seq.visible(window)
    if seq.mask is None:
        keys, values = k, v  # the chunk is the whole context: no need to read the cache
    else:
        keys = k_cache.index_select(0, seq.block_table).flatten(0, 1)[: seq.seq_len].to(q.dtype)
        values = v_cache.index_select(0, seq.block_table).flatten(0, 1)[: seq.seq_len].to(q.dtype)
        # keys, values: [seq_len, num_kv_heads, head_dim]
    group = num_heads // num_kv_heads
    if query_len * seq.seq_len <= _GROUPED_MAX_SCORES or cap is not None:  # SDPA cannot cap
        return _grouped_attention(q, keys, values, mask, scale, cap)
    keys = keys.repeat_interleave(group, dim=1).transpose(0, 1)  # [num_heads, seq_len, head_dim]
    values = values.repeat_interleave(group, dim=1).transpose(0, 1)  # [num_heads, seq_len, head_dim]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), keys, values,  # [num_heads, query_len, head_dim]
        attn_mask=mask, is_causal=mask is None, scale=scale,
    )
    return out.transpose(0, 1).reshape(query_len, num_heads * head_dim)


# up to this many query x key pairs a chunk attends with two grouped matmuls (faster here than
# SDPA's CPU kernel for short chunks); beyond it, SDPA, whose memory does not grow with the scores
_GROUPED_MAX_SCORES = 512 * 2048


def _grouped_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
                       scale: float, cap: float | None = None) -> torch.Tensor:
    """Attention of one chunk (``mask`` [query_len, seq_len] the keys each token sees, None for
    causal over the chunk), the query heads of each KV head stacked into one matmul (no copy of K
    or V per query head). q: [query_len, num_heads, head_dim]; keys, values: [seq_len,
    num_kv_heads, head_dim] -> [query_len, num_heads * head_dim]."""
    query_len, num_heads, head_dim = q.shape
    seq_len, num_kv_heads = keys.shape[0], keys.shape[1]
    group = num_heads // num_kv_heads
    stacked = q.view(query_len, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
    stacked = stacked.reshape(num_kv_heads, group * query_len, head_dim)  # [kv_heads, group * query_len, dim]
    scores = torch.bmm(stacked, keys.permute(1, 2, 0)).float()  # [kv_heads, group * query_len, seq_len]
    scores = scores.view(num_kv_heads, group, query_len, seq_len)
    visible = mask if mask is not None else torch.ones(
        query_len, seq_len, dtype=torch.bool, device=q.device).tril_()  # [query_len, seq_len]
    scores = soft_cap(scores.mul_(scale), cap).masked_fill_(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(q.dtype).view(num_kv_heads, group * query_len, seq_len)
    out = torch.bmm(probs, values.transpose(0, 1))  # [kv_heads, group * query_len, dim]
    return out.view(num_kv_heads, group, query_len, head_dim).permute(2, 0, 1, 3).reshape(
        query_len, num_heads * head_dim)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, head_slot: torch.Tensor,
                    window: int | None = None, cap: float | None = None) -> torch.Tensor:
    """q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim].

    Writes k, v into the cache, then returns the attention output [num_tokens, num_heads * head_dim].
    ``head_slot`` [num_heads, num_kv_heads] bool marks each query head's KV head (see ``kv_head_slots``);
    with a sliding ``window`` each token sees only the last ``window`` positions up to its own; ``cap``
    soft-caps the scores.
    """
    num_decodes = meta.num_decode_tokens
    write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    parts = []
    if num_decodes:
        parts.append(_decode_attention(q[:num_decodes], k_cache, v_cache, meta, scale, head_slot, window,
                                       cap).to(q.dtype))
    for seq in meta.prefills:
        sl = slice(seq.query_start, seq.query_start + seq.query_len)
        parts.append(_prefill_attention(q[sl], k[sl], v[sl], k_cache, v_cache, seq, scale, window, cap).to(q.dtype))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)


def kv_head_slots(num_heads: int, num_kv_heads: int) -> torch.Tensor:
    """[num_heads, num_kv_heads] bool: True where query head h reads KV head h // group."""
    group = num_heads // num_kv_heads
    heads = torch.arange(num_heads, device="cpu")  # explicit: models are built under a meta device
    slots = torch.zeros(num_heads, num_kv_heads, dtype=torch.bool, device="cpu")
    slots[heads, heads // group] = True
    return slots


class PagedAttention(nn.Module):
    """The attention of one layer over its paged KV cache (``paged_attention``). A module, so
    that the runner can swap it at the edge like the linears (``duoserve.worker.backends``)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float | None = None,
                 window: int | None = None, cap: float | None = None) -> None:
        super().__init__()
        self.scale = head_dim ** -0.5 if scale is None else scale
        self.window = window   # a sliding window (tokens), or None to attend over the whole context
        self.cap = cap         # soft-capping of the scores, or None
        self.register_buffer("head_slot", kv_head_slots(num_heads, num_kv_heads), persistent=False)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        """q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim] ->
        [num_tokens, num_heads * head_dim]."""
        return paged_attention(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale, self.head_slot, self.window,
                               self.cap)
