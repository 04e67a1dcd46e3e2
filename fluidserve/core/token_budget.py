"""Token budget from a time-between-tokens SLO (Sarathi-Serve §4.3, automated).

A stall-free iteration never holds more than ``budget`` tokens, so the slowest iteration,
and with it the P99 TBT, is the time of a full batch. The budget is the largest multiple of
the tile size whose full batch still runs within the SLO: chunk sizes that are not tile
multiples pay for the whole tile anyway.
"""

from __future__ import annotations

from collections.abc import Callable


def round_to_tile(n: int, tile: int) -> int:
    return n - n % tile if tile > 1 else n


def find_token_budget(
    batch_time: Callable[[int], float], tbt_slo: float, tile: int = 1, max_budget: int = 16384
) -> tuple[int, float]:
    """Largest tile multiple B <= max_budget with batch_time(B) <= tbt_slo, and its time.

    ``batch_time`` must be non-decreasing in B. Returns (0, time of one tile) if even the
    smallest budget misses the SLO.
    """
    if tbt_slo <= 0:
        raise ValueError("tbt_slo must be > 0")
    lo, hi = 0, max_budget // tile  # in tiles; lo meets the SLO (0 trivially), hi unknown
    if hi and batch_time(hi * tile) <= tbt_slo:
        return hi * tile, batch_time(hi * tile)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if batch_time(mid * tile) <= tbt_slo:
            lo = mid
        else:
            hi = mid
    return lo * tile, batch_time(max(lo, 1) * tile)
