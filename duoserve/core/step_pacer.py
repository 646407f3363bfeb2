"""A step's token budget by time, under the latency policies (priority, fair share).

A request that outranks the running ones waits, at worst, for the step in progress: that step's
length is its wait, whatever its tokens. On a CPU a step costs about the same per token at any
batch past a few dozen rows (BENCHMARKS.md, session 34), so a step kept short costs little
throughput. The pacer keeps a moving average of the tokens a second this engine's steps compute
and gives the budget that takes ``target_s``: between ``MIN_STEP_TOKENS`` and the configured
budget, which it starts from. When the running requests outnumber the budget, the scheduler
serves them in turn (the least recently served first, within a rank).
"""

from __future__ import annotations

MIN_STEP_TOKENS = 16    # a step at least this big, however slow the model
SMOOTHING = 0.2         # the moving average's weight of the newest step


class StepPacer:
    def __init__(self, target_s: float, max_tokens: int) -> None:
        self.target_s = target_s
        self.max_tokens = max_tokens
        self.tokens_per_s: float | None = None   # measured: None until a step was

    def observe(self, num_tokens: int, seconds: float) -> None:
        """One step's tokens and the seconds it took (its model time: no waiting counted)."""
        if num_tokens <= 0 or seconds <= 0:
            return
        rate = num_tokens / seconds
        self.tokens_per_s = rate if self.tokens_per_s is None else (
            SMOOTHING * rate + (1 - SMOOTHING) * self.tokens_per_s)

    def budget(self) -> int:
        if self.tokens_per_s is None:
            return self.max_tokens
        return max(MIN_STEP_TOKENS, min(self.max_tokens, int(self.tokens_per_s * self.target_s)))
