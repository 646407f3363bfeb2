"""What an engine measures of itself, averaged: one rule for every rate it reports, and the sizes
of step it keeps them by (placement predicts from the rate of the step it expects)."""

from __future__ import annotations

import bisect
from collections.abc import Sequence

# a step's prompt tokens, lower bounds: a short step spends more a token on reading the weights, a
# long one on attention, so prompt tokens a second are kept for each
PROMPT_SIZES = (32, 128, 512, 2048)
# a step's decodes, lower bounds: a step of many reads the same weights as one of one, plus each one's KV
BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)


def moving_average(average: float, sample: float, weight: float = 0.2) -> float:
    """The first sample (an average of 0 means none yet), then each new one weighs ``weight``."""
    return sample if average == 0.0 else (1 - weight) * average + weight * sample


def size_index(sizes: Sequence[int], size: int) -> int:
    """The index of the last of ``sizes`` (ascending) at most ``size`` (0 below the first)."""
    return max(bisect.bisect_right(sizes, size) - 1, 0)


def record(rates: list[float], sizes: Sequence[int], size: int, sample: float) -> None:
    """Average ``sample`` into the rate kept for steps of ``size``."""
    i = size_index(sizes, size)
    rates[i] = moving_average(rates[i], sample)


def lookup(rates: Sequence[float], sizes: Sequence[int], size: int) -> float:
    """The rate of steps of ``size``; unmeasured, the nearest measured size's (the smaller of two
    as near); 0 when none is measured."""
    i = size_index(sizes, size)
    measured = [j for j, rate in enumerate(rates) if rate > 0]
    if not measured:
        return 0.0
    return rates[min(measured, key=lambda j: (abs(j - i), j))]
