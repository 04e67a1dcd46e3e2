"""Latency metrics from per-token timestamps, shared by the engine, simulator and client.

Every metric derives from a request's arrival time, the time its first chunk was scheduled
(when the server reports it) and the arrival times of its output tokens.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class RequestLatency:
    ttft: float | None  # first token time - arrival
    tbt: list[float]  # every inter-token gap
    e2e: float | None  # last token time - arrival
    tpot: float | None  # (e2e - ttft) / (output tokens - 1)
    normalized_latency: float | None  # e2e / output tokens
    scheduling_delay: float | None  # first scheduled - arrival

    def to_dict(self) -> dict:
        return {f: getattr(self, f) for f in self.__dataclass_fields__}  # no deep copy


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
    xs = [v for v in values if v is not None]
    return float(np.percentile(xs, q)) if xs else math.nan


def summarize(values: Sequence[float]) -> dict[str, float]:
    xs = np.asarray([v for v in values if v is not None], dtype=float)
    if not len(xs):
        nan = math.nan
        return {"mean": nan, "p50": nan, "p90": nan, "p99": nan, "max": nan, "count": 0}
    p50, p90, p99 = np.percentile(xs, [50, 90, 99])
    return {"mean": float(xs.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99),
            "max": float(xs.max()), "count": int(len(xs))}


def json_safe(obj):
    """``obj`` with every float JSON cannot hold (NaN: a statistic over no values; infinity:
    requests sent all at once) as null, and numpy scalars as Python numbers."""
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    if isinstance(obj, (np.floating, np.integer, np.bool_)):
        obj = obj.item()
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def to_json(obj, indent: int | None = None) -> str:
    """Standard JSON (no NaN or Infinity, which ``jq`` and browsers refuse) of a summary."""
    return json.dumps(json_safe(obj), indent=indent, allow_nan=False)
