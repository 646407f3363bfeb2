"""Turn logits into tokens: penalties, logit biases, temperature, top-k/top-p/min-p, seeded draws, logprobs.

A draw inverts the cumulative distribution: one uniform ``u`` per row picks the first
token whose running probability sum exceeds ``u`` times the total, in two levels (the
block of 1024 tokens, then the token within it) so that the float64 running sums stay
short: a token of zero probability can never be picked. One random number a row, not one
per vocabulary entry (exponential noise over the whole vocabulary, or one float64 running
sum over it, costs many times more: BENCHMARKS.md). With a seed, ``u`` comes from a
generator seeded by (seed, output position, sample index) alone, on the CPU, so a draw is the same whatever the batch and
whichever device or process makes it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from duoserve.core.outputs import TokenLogprobs
from duoserve.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1


def draw_seed(seed: int, position: int, sample_index: int) -> int:
    """A 63-bit generator seed from (seed, position, sample index): splitmix64 over the three."""
    x = 0
    for part in (seed, position, sample_index):
        x = (x ^ (part & _MASK64)) + 0x9E3779B97F4A7C15 & _MASK64
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
        x ^= x >> 31
    return x >> 1


@dataclass(slots=True)
class SamplingRow:
    params: SamplingParams
    position: int                 # index among the request's outputs of the token being drawn
    sample_index: int
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    stop_ids_until_min: tuple[int, ...]  # ids forbidden while position < min_tokens (eos, stop ids)


def _apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    vocab = logits.shape[1]
    for i, row in enumerate(rows):
        p = row.params
        if not p.has_penalties:
            continue
        outputs = torch.tensor(row.output_token_ids, dtype=torch.long)
        if p.repetition_penalty != 1.0:
            seen = torch.cat([torch.tensor(row.prompt_token_ids, dtype=torch.long), outputs]).unique()
            values = logits[i, seen]
            logits[i, seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
        if len(outputs) and (p.frequency_penalty or p.presence_penalty):
            counts = torch.bincount(outputs, minlength=vocab)[:vocab].to(logits.dtype)  # [vocab]
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)


def _apply_biases(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """logit_bias added (OpenAI's: +-100 all but forces or bans a token); allowed_token_ids alone
    may be drawn; a bad word's last token is banned where the outputs end with the rest of it.
    Ids past the model's vocabulary (the frontend refuses them) change nothing."""
    vocab = logits.shape[1]
    for i, row in enumerate(rows):
        p = row.params
        outputs = row.output_token_ids
        for ids in p.bad_words_token_ids:
            *head, last = ids
            if last < vocab and (not head or tuple(outputs[-len(head):]) == tuple(head)):
                logits[i, last] = float("-inf")
        if p.logit_bias:
            pairs = [(t, b) for t, b in p.logit_bias.items() if t < vocab]
            if pairs:
                ids = torch.tensor([t for t, _ in pairs], device=logits.device)
                logits[i, ids] += torch.tensor([b for _, b in pairs], dtype=logits.dtype, device=logits.device)
        if p.allowed_token_ids is not None:
            keep = torch.zeros(vocab, dtype=torch.bool, device=logits.device)
            keep[torch.tensor([t for t in p.allowed_token_ids if t < vocab], dtype=torch.long,
                              device=logits.device)] = True
            logits[i].masked_fill_(~keep, float("-inf"))


def _apply_min_tokens(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """Before min_tokens outputs, eos and the stop ids are not drawn, unless nothing else may be
    (a grammar that is complete allows only eos): then the row is left as it is."""
    for i, row in enumerate(rows):
        if row.position < row.params.min_tokens and row.stop_ids_until_min:
            ids = list(row.stop_ids_until_min)
            kept = logits[i, ids].clone()
            logits[i, ids] = float("-inf")
            if not torch.isfinite(logits[i]).any():
                logits[i, ids] = kept


def _truncate(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p, as -inf masks on [R, vocab] logits."""
    vocab = logits.shape[1]
    with_k = [i for i, r in enumerate(rows) if 0 < r.params.top_k < vocab]
    if any(r.params.temperature != 1.0 for r in rows):
        temps = torch.tensor([r.params.temperature for r in rows], dtype=logits.dtype, device=logits.device)
        logits = logits / temps[:, None]
    elif with_k:
        logits = logits.clone()   # top-k writes into its rows below: never into the caller's logits
    if with_k:
        ks = torch.tensor([rows[i].params.top_k for i in with_k], device=logits.device)
        sub = logits[with_k]  # [K, vocab]
        kth = torch.topk(sub, int(ks.max()), dim=-1).values.gather(1, (ks - 1)[:, None])  # [K, 1]
        logits[with_k] = sub.masked_fill(sub < kth, float("-inf"))
    top_ps = [r.params.top_p for r in rows]
    if any(p < 1.0 for p in top_ps):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        ps = torch.tensor(top_ps, dtype=cum.dtype, device=logits.device)[:, None]
        drop_sorted = (cum - sorted_logits.softmax(-1)) >= ps  # keep the token that crosses p
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    min_ps = [r.params.min_p for r in rows]
    if any(min_ps):
        probs = logits.softmax(-1)
        floor = probs.max(-1, keepdim=True).values * torch.tensor(min_ps, device=logits.device)[:, None]
        logits = logits.masked_fill(probs < floor, float("-inf"))
    return logits


# independent uniforms of one seeded draw: the token draw itself (0), speculative decoding's
# acceptance test (1) and the draft model's own draw (2)
STREAM_DRAW, STREAM_ACCEPT, STREAM_DRAFT = 0, 1, 2


def uniforms(rows: list[SamplingRow], generator: torch.Generator | None, stream: int = STREAM_DRAW) -> torch.Tensor:
    """One float64 uniform in [0, 1) per row, on the CPU: per-row seeded generators for seeded
    requests (seeded by seed, position, sample index and ``stream``), ``generator`` for the rest."""
    draws = torch.empty(len(rows), dtype=torch.float64)
    unseeded = [i for i, r in enumerate(rows) if r.params.seed is None]
    if unseeded:
        draws[unseeded] = torch.rand(len(unseeded), generator=generator, dtype=torch.float64)
    for i, row in enumerate(rows):
        if row.params.seed is not None:
            index = row.sample_index + (stream << 40)  # stream 0: the seed rule of every plain draw
            g = torch.Generator().manual_seed(draw_seed(row.params.seed, row.position, index))
            draws[i] = torch.rand(1, generator=g, dtype=torch.float64)[0]
    return draws


_DRAW_BLOCK = 1024


def draw_from(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """probs [S, vocab] (rows need not be normalized), uniforms [S] in [0, 1) -> token ids [S]."""
    num_rows, vocab = probs.shape
    num_blocks = -(-vocab // _DRAW_BLOCK)
    padding = num_blocks * _DRAW_BLOCK - vocab
    blocks = (F.pad(probs.float(), (0, padding)) if padding else probs.float()).view(num_rows, num_blocks, _DRAW_BLOCK)
    block_sums = blocks.sum(dim=-1).double()  # [S, num_blocks]
    block_cdf = block_sums.cumsum(dim=-1)
    targets = uniforms.to(block_cdf.device) * block_cdf[:, -1]  # [S]
    block = torch.searchsorted(block_cdf, targets[:, None], right=True)[:, 0].clamp_(max=num_blocks - 1)
    rows = torch.arange(num_rows, device=probs.device)
    rest = targets - (block_cdf[rows, block] - block_sums[rows, block])  # mass to cover inside the block
    inside = blocks[rows, block]  # [S, block]
    offset = torch.searchsorted(inside.double().cumsum(dim=-1), rest[:, None], right=True)[:, 0]
    # rounding between the two levels can overshoot the block: take its last token of nonzero probability
    last_nonzero = _DRAW_BLOCK - 1 - (inside > 0).flip(-1).int().argmax(dim=-1)
    return block * _DRAW_BLOCK + torch.minimum(offset, last_nonzero)


def top_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, num_top: list[int]) -> list[TokenLogprobs]:
    """logprobs [R, vocab], chosen token_ids [R] -> one TokenLogprobs per row (top num_top[i])."""
    chosen = logprobs.gather(1, token_ids[:, None])  # [R, 1]
    ranks = (logprobs > chosen).sum(-1) + 1  # [R]
    k = max(num_top) if num_top else 0
    top_vals, top_ids = logprobs.topk(k, dim=-1) if k else (None, None)
    chosen_l, ranks_l, ids_l = chosen[:, 0].tolist(), ranks.tolist(), token_ids.tolist()
    vals_l = top_vals.tolist() if k else None
    tops_l = top_ids.tolist() if k else None
    result = []
    for i, n in enumerate(num_top):
        top = list(zip(tops_l[i][:n], vals_l[i][:n])) if n else []
        result.append(TokenLogprobs(ids_l[i], chosen_l[i], ranks_l[i], top))
    return result


def adjusted(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """The logits with penalties, biases and min_tokens applied (a copy where any applies)."""
    if any(r.params.has_penalties or r.params.has_biases or r.position < r.params.min_tokens for r in rows):
        logits = logits.clone()
        _apply_penalties(logits, rows)
        _apply_biases(logits, rows)
        _apply_min_tokens(logits, rows)
    return logits


def probabilities(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """The distribution a sampled row draws from: [R, vocab] adjusted, truncated, softmaxed."""
    return _truncate(adjusted(logits, rows), rows).softmax(-1)


def logprobs_of(raw: torch.Tensor, rows: list[SamplingRow], tokens: torch.Tensor) -> list[TokenLogprobs | None]:
    """Per row, the log-probabilities its request asked for (of the raw logits), or None."""
    want = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    result: list[TokenLogprobs | None] = [None] * len(rows)
    if want:
        lp = torch.log_softmax(raw[want], dim=-1)
        for i, entry in zip(want, top_logprobs(lp, tokens[want], [rows[i].params.logprobs for i in want])):
            result[i] = entry
    return result


def sample_tensor(logits: torch.Tensor, rows: list[SamplingRow], generator: torch.Generator | None = None,
                  stream: int = STREAM_DRAW) -> tuple[torch.Tensor, torch.Tensor | None, list[int]]:
    """Tokens [R] drawn from float32 logits [R, vocab]; also the distributions of the sampled rows
    [S, vocab] (None if all are greedy) and which rows those are."""
    logits = adjusted(logits, rows)
    sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
    if len(sampled) < len(rows):
        tokens = logits.argmax(dim=-1)  # [R]: the greedy answer, replaced below for sampled rows
    else:
        tokens = torch.empty(len(rows), dtype=torch.long, device=logits.device)
    probs = None
    if sampled:
        sub_rows = [rows[i] for i in sampled]
        sub = logits if len(sampled) == len(rows) else logits[sampled]
        probs = _truncate(sub, sub_rows).softmax(-1)  # [S, vocab]
        tokens[sampled] = draw_from(probs, uniforms(sub_rows, generator, stream))
    return tokens, probs, sampled


def sample(logits: torch.Tensor, rows: list[SamplingRow],
           generator: torch.Generator | None = None) -> tuple[list[int], list[TokenLogprobs | None]]:
    """logits: float32 [R, vocab], one row per draw. Returns tokens and per-row logprobs (or None)."""
    tokens, _, _ = sample_tensor(logits, rows, generator)
    return tokens.tolist(), logprobs_of(logits, rows, tokens)
