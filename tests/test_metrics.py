"""Per-request latency metrics and their summaries, on hand-computed timelines."""

from __future__ import annotations

import math

import pytest

from fluidserve.metrics import percentile, request_latency, summarize


def test_request_latency_from_token_times():
    # Arrival at 10 s, scheduled 1/8 s later, four tokens (two arrive together).
    lat = request_latency(10.0, [10.5, 10.75, 10.75, 11.5], first_scheduled=10.125)
    assert lat.ttft == 0.5 and lat.e2e == 1.5 and lat.scheduling_delay == 0.125
    assert lat.tbt == [0.25, 0.0, 0.75]
    assert lat.tpot == pytest.approx(1.0 / 3)  # (last - first) / (tokens - 1)
    assert lat.normalized_latency == 1.5 / 4  # e2e / tokens
    assert lat.to_dict() == {"ttft": 0.5, "tbt": [0.25, 0.0, 0.75], "e2e": 1.5,
                             "tpot": lat.tpot, "normalized_latency": 0.375,
                             "scheduling_delay": 0.125}
    two = request_latency(0.0, [0.5, 1.25])
    assert two.tpot == 0.75 and two.tbt == [0.75]


def test_request_latency_of_one_token_and_of_none():
    one = request_latency(2.0, [2.25])
    assert (one.ttft, one.e2e, one.tbt, one.tpot) == (0.25, 0.25, [], None)
    assert one.normalized_latency == 0.25 and one.scheduling_delay is None
    none = request_latency(2.0, [], first_scheduled=2.5)
    assert none.ttft is none.e2e is none.tpot is none.normalized_latency is None
    assert none.tbt == [] and none.scheduling_delay == 0.5


def test_percentile_interpolates_linearly_and_skips_missing_values():
    assert percentile([4.0, None, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile([0.0, 10.0], 90) == 9.0
    assert percentile([7.0], 99) == 7.0
    assert math.isnan(percentile([], 50)) and math.isnan(percentile([None], 50))


def test_summarize():
    s = summarize([4.0, 1.0, None, 3.0, 2.0])
    assert s == pytest.approx({"mean": 2.5, "p50": 2.5, "p90": 3.7, "p99": 3.97, "max": 4.0,
                               "count": 4})
    assert isinstance(s["count"], int) and all(isinstance(s[k], float) for k in s if k != "count")
    empty = summarize([None])
    assert empty["count"] == 0
    assert all(math.isnan(empty[k]) for k in ("mean", "p50", "p90", "p99", "max"))
