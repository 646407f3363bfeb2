"""A step's token budget by time (``--max-step-ms``: on by default under priority, opt-in under fair).

A request that outranks the running ones waits, at worst, for the step in progress: that step's
length is its wait, whatever its tokens. On a CPU a step costs about the same per token at any
batch past a few dozen rows (BENCHMARKS.md, session 34), so a step kept short costs little
throughput. The pacer keeps a moving average of the tokens a second this engine's steps compute
and gives the budget that takes ``target_s``: at most the configured budget, which it starts from,
and at least ``MIN_STEP_TOKENS`` where that is less. Only steps that used most of their budget are
measured: a step's fixed cost would make a light one look slow and shrink the budget for nothing.
The scheduler serves the running requests in turn under it (the least recently served first,
within a rank).
"""

from __future__ import annotations

MIN_STEP_TOKENS = 16    # a step at least this big, however slow the model
SMOOTHING = 0.2         # the moving average's weight of the newest step
FULL_ENOUGH = 0.8       # a step measured: one that used at least this share of its budget


class StepPacer:
    def __init__(self, target_s: float, max_tokens: int) -> None:
        self.target_s = target_s
        self.max_tokens = max_tokens
        self.tokens_per_s: float | None = None   # measured: None until a step was

    def observe(self, num_tokens: int, seconds: float, budget: int) -> None:
        """One step's tokens, the seconds it took (its model time: no waiting counted) and its budget."""
        if num_tokens <= 0 or seconds <= 0 or num_tokens < FULL_ENOUGH * budget:
            return
        rate = num_tokens / seconds
        self.tokens_per_s = rate if self.tokens_per_s is None else (
            SMOOTHING * rate + (1 - SMOOTHING) * self.tokens_per_s)

    def budget(self) -> int:
        if self.tokens_per_s is None:
            return self.max_tokens
        return min(self.max_tokens, max(MIN_STEP_TOKENS, int(self.tokens_per_s * self.target_s)))
