"""Latency metrics from per-token timestamps, shared by the engine, simulator and client.

Every metric derives from a request's arrival time, the time its first chunk was scheduled
(when the server reports it) and the arrival times of its output tokens.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class RequestLatency:
    ttft: float | None  # first token time - arrival
    tbt: list[float]  # every inter-token gap
    e2e: float | None  # last token time - arrival
    tpot: float | None  # (e2e - ttft) / (output tokens - 1)
    normalized_latency: float | None  # e2e / output tokens
    scheduling_delay: float | None  # first scheduled - arrival

    def to_dict(self) -> dict:
        return asdict(self)


def request_latency(
    arrival: float, token_times: Sequence[float], first_scheduled: float | None = None
) -> RequestLatency:
    n = len(token_times)
    ttft = token_times[0] - arrival if n else None
    e2e = token_times[-1] - arrival if n else None
    tbt = [b - a for a, b in zip(token_times, token_times[1:], strict=False)]
    tpot = (token_times[-1] - token_times[0]) / (n - 1) if n > 1 else None
    delay = first_scheduled - arrival if first_scheduled is not None else None
    return RequestLatency(ttft, tbt, e2e, tpot, e2e / n if n else None, delay)


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]); NaN for no values."""
    xs = sorted(v for v in values if v is not None)
    if not xs:
        return math.nan
    k = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summarize(values: Sequence[float]) -> dict[str, float]:
    xs = [v for v in values if v is not None]
    mean = sum(xs) / len(xs) if xs else math.nan
    return {
        "mean": mean,
        "p50": percentile(xs, 50),
        "p90": percentile(xs, 90),
        "p99": percentile(xs, 99),
        "max": max(xs) if xs else math.nan,
        "count": len(xs),
    }
