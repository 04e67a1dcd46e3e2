"""Etalon's deadline-based metrics: fluidity-index and fluid token generation rate.

Every output token has a deadline: the first ``D_p`` after arrival, each later one ``D_d``
after the previous deadline. A token that beats its deadline banks the difference as slack
for the tokens after it. A token that misses re-bases every later deadline on its own
arrival and is charged once per ``D_d`` that elapsed (so a 1 s stall at D_d = 0.1 s costs
about ten misses, whether it happens early or late in the stream), and the slack resets.

    fluidity-index = 1 - missed deadlines / all deadlines

The fluid token generation rate is the inverse of the smallest ``D_d`` at which 99% of the
requests keep fluidity-index >= 0.9 (first token excluded): an order statistic, the
``ceil(0.99 n)``-th smallest of the requests' own smallest fluid deadlines (Etalon's code
interpolates between the two largest, which below 100 requests gives a deadline at which
fewer than 99% are fluid). A request that failed is fluid at no deadline.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

TARGET_FLUIDITY = 0.9
TARGET_QUANTILE = 0.99


def deadline_counts(gaps: Sequence[float], d_p: float, d_d: float,
                    ignore_first: bool = False) -> tuple[int, int]:
    """(missed, total) deadlines for one request; gaps[0] is TTFT, then inter-token gaps."""
    missed = total = 0
    slack = 0.0
    for i, g in enumerate(gaps):
        if i == 0 and ignore_first:
            continue
        budget = (d_p if i == 0 else d_d) + slack
        if g <= budget:
            slack = budget - g
            total += 1
            continue
        late = g - slack - (d_p if i == 0 else 0.0)
        n = (1 + math.floor(late / d_d)) if i == 0 else math.floor(late / d_d)
        missed += n
        total += n
        slack = 0.0
    return missed, total


def fluidity_index(gaps: Sequence[float], d_p: float, d_d: float) -> float:
    """1 - miss rate; 1.0 for a request with no tokens (nothing was late)."""
    missed, total = deadline_counts(gaps, d_p, d_d)
    return 1.0 - missed / total if total else 1.0


def min_tbt_deadline(gaps: Sequence[float], target: float = TARGET_FLUIDITY,
                     rel_tol: float = 1e-4) -> float:
    """Smallest D_d whose fluidity-index (first token excluded) reaches ``target``."""
    decode = list(gaps[1:])
    if not decode or max(decode) <= 0:  # (every token bundled into the first chunk)
        return 0.0
    lo, hi = 0.0, max(max(decode), 1e-9)  # at D_d = max gap nothing misses

    def ok(d: float) -> bool:
        m, t = deadline_counts([0.0] + decode, 0.0, d, ignore_first=True)
        return not t or 1 - m / t >= target

    while hi - lo > rel_tol * hi:
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if ok(mid) else (mid, hi)
    return hi


FLUID_RATE_MAX_REQUESTS = 1000


def fluid_token_rate(all_gaps: Sequence[Sequence[float]], num_failed: int = 0,
                     max_requests: int = FLUID_RATE_MAX_REQUESTS) -> tuple[float, float]:
    """(tokens/s, the D_d behind it): 1 / the P99 (an order statistic) over requests of
    their min_tbt_deadline; ``num_failed`` requests besides, fluid at no deadline (with more
    than 1% of them failed, no deadline makes 99% fluid: 0 tokens/s at D_d = inf).

    Above ``max_requests`` requests an evenly spaced subset of that size is used (the
    per-request search is the costly part; a P99 over 1000 requests is stable to ~1%).
    """
    streams: list = [g for g in all_gaps if len(g) > 1] + [None] * num_failed
    if len(streams) > max_requests:
        step = len(streams) / max_requests
        streams = [streams[int(i * step)] for i in range(max_requests)]
    ds = sorted(math.inf if g is None else min_tbt_deadline(g) for g in streams)
    if not ds:
        return math.nan, math.nan
    d = ds[max(math.ceil(TARGET_QUANTILE * len(ds) - 1e-9), 1) - 1]
    return (1.0 / d if d > 0 else math.inf), d


def miss_rate_curve(all_gaps: Sequence[Sequence[float]], d_values: Sequence[float],
                    quantile: float = TARGET_QUANTILE) -> list[float]:
    """For each target D_d, the ``quantile`` over requests of their decode deadline-miss rate."""
    out = []
    for d in d_values:
        rates = []
        for g in all_gaps:
            m, t = deadline_counts([0.0] + list(g[1:]), 0.0, d, ignore_first=True)
            rates.append(m / t if t else 0.0)
        out.append(float(np.quantile(rates, quantile)) if rates else math.nan)
    return out
