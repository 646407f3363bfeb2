"""What an engine measures of itself, averaged: one rule for every rate it reports."""


def moving_average(average: float, sample: float, weight: float = 0.2) -> float:
    """The first sample (an average of 0 means none yet), then each new one weighs ``weight``."""
    return sample if average == 0.0 else (1 - weight) * average + weight * sample
