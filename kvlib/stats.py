"""Small statistics the chapters share: intervals for rates measured on few trials.

A passkey retrieved by 17 of 24 prompts is a rate of 71%, but with 24 trials the rate could as well be 50% or
85%: the chapters print such rates with their 95% Wilson score interval and state a verdict only where two
intervals do not overlap (``separated``).

>>> lo, hi = wilson(17, 24)
>>> round(lo, 3), round(hi, 3)
(0.508, 0.851)
>>> separated(wilson(24, 24), wilson(5, 24)), separated(wilson(12, 24), wilson(9, 24))
(True, False)
"""

from __future__ import annotations

import math

__all__ = ["wilson", "separated"]


def wilson(k: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """The Wilson score interval (Wilson, 1927) of a rate ``k`` successes in ``n`` trials: (low, high) in [0, 1].

    ``z`` = 1.96 gives 95%. Unlike the normal approximation p ± z·sqrt(p(1-p)/n), it stays inside [0, 1] and
    is not zero-width at 0 of n or n of n.
    """
    if isinstance(k, bool) or not isinstance(k, int) or isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(f"k and n must be ints (successes, trials), got {type(k).__name__} and {type(n).__name__}")
    if n < 1 or not 0 <= k <= n:
        raise ValueError(f"need 0 <= k <= n and n >= 1 (successes k of n trials), got k={k}, n={n}")
    if not z > 0:
        raise ValueError(f"z must be positive (1.96 for a 95% interval), got {z}")
    p = k / n
    centre, half = p + z * z / (2 * n), z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, (centre - half) / (1 + z * z / n)), min(1.0, (centre + half) / (1 + z * z / n))


def separated(a: tuple[float, float], b: tuple[float, float]) -> bool:
    """True when two intervals (low, high) do not overlap: the only case in which the chapters call one rate
    higher than the other."""
    return a[1] < b[0] or b[1] < a[0]
