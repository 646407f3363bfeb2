"""Structured outputs in a step: which tokens each sampled row may draw, and the matchers advanced.

A constrained request's rows get llguidance's mask (one bit per token) from its matcher: its
first token's row (copied to each of an n > 1 prompt's rows, which start alike), and for a
speculating request the row after each guess too, computed with the guesses consumed one by
one and then rolled back (a guess outside the grammar leaves the rows after it free: the
target's masked row there never draws it, so verification stops before them). The rows'
logits outside the mask become -inf before sampling; log-probabilities stay the model's.
After sampling, each request's matcher consumes the tokens it keeps; a token after which the
grammar can go no further ends the request.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from duoserve.core.outputs import ScheduledRequest
from duoserve.structured.cache import GrammarCache
from duoserve.structured.grammar import GrammarError

def fill_mask_row(matcher, bitmask: torch.Tensor, row: int) -> None:
    """The matcher writes its next-token mask into row ``row`` of ``bitmask`` (int32, CPU,
    contiguous rows: as ``GrammarMasks.fill`` allocates it) itself: llguidance's own call, made here
    rather than through ``llguidance.torch``, whose import pulls in torch.compile's whole stack
    (seconds of every engine's start, compiled or not)."""
    words = bitmask[row]
    matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * words.element_size())


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bitmask [R, ceil(vocab / 32)] int32 (bit j of word w: token 32w + j) -> bool [R, vocab].
    numpy unpacks the bits (little-endian words: byte order is bit order) 30x faster than shifts."""
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")[:, :vocab_size]
    return torch.from_numpy(np.ascontiguousarray(bits)).view(torch.bool)


@dataclass
class StepMasks:
    """One step's masks: rows ``rows`` of the step's sampling rows are constrained."""
    bitmask: torch.Tensor                    # [len(rows), words]
    rows: list[int]
    failed: dict[str, str] = field(default_factory=dict)   # request id -> why its grammar broke

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """A copy of ``logits`` [R, vocab] with each constrained row's disallowed tokens at -inf."""
        allowed = allowed_tokens(self.bitmask, logits.shape[1]).to(logits.device)
        if len(self.rows) == logits.shape[0]:   # every row constrained: one pass, no copy first
            return torch.where(allowed, logits, float("-inf"))
        masked = logits.clone()
        index = torch.tensor(self.rows, device=logits.device)
        masked[index] = torch.where(allowed, masked[index], float("-inf"))
        return masked


class GrammarMasks:
    def __init__(self, cache: GrammarCache, vocab_size: int) -> None:
        self.cache = cache
        self.words = -(-vocab_size // 32)
        self.mask_seconds = 0.0     # cumulative, for the metrics
        self.num_masks = 0
        self.num_steps = 0

    def fill(self, owners: list[tuple[ScheduledRequest, int]]) -> StepMasks | None:
        """Masks for the constrained ones of ``owners``: (item, its first sampling row), or None
        when no request of the step is constrained."""
        constrained = [(item, first) for item, first in owners if item.request.params.structured_outputs]
        if not constrained:
            return None
        start = time.perf_counter()
        rows = [first + k for item, first in constrained
                for k in range(item.num_samples + len(item.spec_token_ids))]
        bitmask = torch.full((len(rows), self.words), -1, dtype=torch.int32)   # -1: every token
        masks = StepMasks(bitmask, rows)
        at = 0
        for item, _ in constrained:
            count = item.num_samples + len(item.spec_token_ids)
            try:
                matcher = self.cache.matcher(item.request)
            except GrammarError as exc:
                masks.failed[item.request.request_id] = str(exc)
                at += count
                continue
            fill_mask_row(matcher, bitmask, at)
            bitmask[at + 1:at + item.num_samples] = bitmask[at]
            consumed = 0
            for guess in item.spec_token_ids:
                if matcher.is_stopped() or matcher.validate_tokens([guess]) != 1 or not matcher.consume_token(guess):
                    break
                consumed += 1
                fill_mask_row(matcher, bitmask, at + consumed)
            if consumed:
                matcher.rollback(consumed)
            at += count
        self.mask_seconds += time.perf_counter() - start
        self.num_masks += len(rows)
        self.num_steps += 1
        return masks

    def accept(self, item: ScheduledRequest, tokens: list[int]) -> list[bool]:
        """Advance the request's matcher by the tokens it keeps; per token, whether the grammar
        is complete after it (nothing may follow). An n > 1 prompt's first tokens are one per
        sample: the request's own matcher takes the first, copies tell for the others (each
        sample makes its own matcher when it first samples)."""
        state = item.request.grammar
        if item.num_samples > 1:
            copies = [state.matcher.deep_copy() for _ in tokens[1:]]   # before the first sample's token
            others = [copy.consume_token(t) and copy.is_stopped() for copy, t in zip(copies, tokens[1:])]
            return [*self._consume(state, tokens[:1]), *others]
        return self._consume(state, tokens)

    def stats(self) -> dict:
        return {**self.cache.stats(), "grammar_mask_steps": self.num_steps, "grammar_num_masks": self.num_masks,
                "grammar_mask_seconds": self.mask_seconds}

    @staticmethod
    def _consume(state, tokens: list[int]) -> list[bool]:
        ended = []
        for token in tokens:
            if not state.matcher.consume_token(token):
                raise GrammarError(f"token {token} is outside the grammar: {state.matcher.get_error()}")
            ended.append(state.matcher.is_stopped())
        state.num_consumed += len(tokens)
        return ended
