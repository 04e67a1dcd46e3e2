"""Etalon's deadline metrics against an independent reference, on thousands of timelines.

The reference below is written from the definition (the module docstring of
``fluidserve.bench.fluidity`` and the Etalon paper, arXiv:2407.07000), in absolute time
rather than in the module's per-gap slack arithmetic:

- the first token's deadline is D_p after arrival; every later token's deadline is D_d after
  the previous token's deadline;
- a token arriving at or before its deadline meets it;
- a token arriving after its deadline misses it and every later deadline of the same
  cadence up to its arrival (a stall of k * D_d costs about k misses), and the cadence
  restarts from the late token's arrival.

fluidity-index = 1 - missed / (met + missed). A request's minimal TBT deadline is the
smallest D_d at which its fluidity-index (first token excluded) reaches 0.9; the fluid token
generation rate is 1 / the P99 over requests of that deadline.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from fluidserve.bench.fluidity import (
    FLUID_RATE_MAX_REQUESTS,
    TARGET_FLUIDITY,
    TARGET_QUANTILE,
    deadline_counts,
    fluid_token_rate,
    fluidity_index,
    min_tbt_deadline,
    miss_rate_curve,
)


def ref_counts(gaps, d_p: float, d_d: float, ignore_first: bool = False) -> tuple[int, int]:
    """(missed, total) deadlines of one request whose token i arrives sum(gaps[:i+1])."""
    missed = met = 0
    t = deadline = 0.0
    for i, gap in enumerate(gaps):
        t += gap
        if i == 0 and ignore_first:
            deadline = t  # the cadence starts at the first token
            continue
        deadline = d_p if i == 0 else deadline + d_d
        if t <= deadline:
            met += 1
            continue
        missed += 1 + math.floor((t - deadline) / d_d)  # deadline, deadline + D_d, ... <= t
        deadline = t
    return missed, met + missed


def ref_fluid(gaps, d_d: float) -> bool:
    missed, total = ref_counts(gaps, 0.0, d_d, ignore_first=True)
    return total == 0 or 1 - missed / total >= TARGET_FLUIDITY


def ref_min_deadline(gaps) -> float:
    """Smallest fluid D_d to 1e-12 (fluidity is non-decreasing in D_d: slack only grows)."""
    lo, hi = 0.0, sum(gaps[1:]) + 1.0  # with D_d above every gap nothing is late
    while hi - lo > 1e-12 * hi:
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if ref_fluid(gaps, mid) else (mid, hi)
    return hi


def timeline(rng: np.random.Generator, exact: bool) -> list[float]:
    """A token timeline: steady, jittery, stalled (a long gap) or bundled (zero gaps)."""
    n = int(rng.integers(1, 60))
    if exact:  # multiples of 1/16 s: every sum below is exact, ties included
        gaps = rng.integers(0, 8, n) / 16
        stalls = rng.random(n) < 0.05
        gaps[stalls] = rng.integers(8, 64, stalls.sum()) / 16
    else:
        gaps = rng.gamma(rng.uniform(0.5, 8), 0.02, n)
        gaps[rng.random(n) < 0.1] = 0.0  # tokens that arrived in one chunk
        stalls = rng.random(n) < 0.05
        gaps[stalls] += rng.uniform(0.2, 2.0, stalls.sum())
    return [float(g) for g in gaps]


DEADLINES = [(1.0, 0.25), (0.5, 0.0625), (0.25, 0.125), (2.0, 0.5), (0.0625, 0.1875)]


@pytest.mark.parametrize("exact", [True, False], ids=["dyadic", "real"])
def test_deadline_counts_match_the_reference_on_random_timelines(exact):
    rng = np.random.default_rng(11 if exact else 12)
    for _ in range(2000):
        gaps = timeline(rng, exact)
        d_p, d_d = DEADLINES[int(rng.integers(len(DEADLINES)))]
        for ignore_first in (False, True):
            want = ref_counts(gaps, d_p, d_d, ignore_first)
            assert deadline_counts(gaps, d_p, d_d, ignore_first) == want, (gaps, d_p, d_d)
        missed, total = ref_counts(gaps, d_p, d_d)
        assert fluidity_index(gaps, d_p, d_d) == pytest.approx(1 - missed / total)


def test_min_tbt_deadline_matches_the_reference():
    rng = np.random.default_rng(13)
    for i in range(600):
        gaps = timeline(rng, exact=i % 2 == 0)
        if not any(gaps[1:]):
            continue  # no decode gap to meet: nothing to search for
        want, got = ref_min_deadline(gaps), min_tbt_deadline(gaps)
        assert want * (1 - 1e-9) <= got <= want * (1 + 2e-4), gaps  # the search's tolerance
        assert ref_fluid(gaps, got)


def test_min_tbt_deadline_ignores_the_first_token():
    assert min_tbt_deadline([5.0, 0.25, 0.25, 0.25]) == pytest.approx(0.25, rel=2e-4)
    assert min_tbt_deadline([0.0]) == 0.0 and min_tbt_deadline([]) == 0.0


def p99(values) -> float:
    """The smallest value that at least 99% of ``values`` do not exceed (an order statistic)."""
    v = sorted(float(x) for x in values)
    return v[math.ceil(TARGET_QUANTILE * len(v) - 1e-9) - 1]


def reference_rate(streams) -> tuple[float, float]:
    d = p99(ref_min_deadline(g) for g in streams if len(g) > 1)
    return 1 / d, d


def test_fluid_token_rate_is_the_p99_over_mixed_streams():
    """The headline metric: a few slow or stalled streams among many fast ones set it."""
    rng = np.random.default_rng(14)
    streams = [timeline(rng, exact=False) for _ in range(300)]
    streams += [[0.1] + [0.02] * 40 for _ in range(60)]  # fast and steady
    streams += [[0.1] + [0.3] * 20 for _ in range(3)]  # slow: these set the P99
    want_rate, want_d = reference_rate(streams)
    rate, d = fluid_token_rate(streams)
    assert d == pytest.approx(want_d, rel=2e-4) and rate == pytest.approx(want_rate, rel=2e-4)
    median = float(np.median([ref_min_deadline(g) for g in streams if len(g) > 1]))
    assert d > 2 * median  # a median would hide the slow streams


def test_fluid_token_rate_of_steady_streams_at_different_cadences():
    # Stream k produces a token every c_k seconds, so its minimal deadline is exactly c_k.
    cadences = np.linspace(0.01, 0.2, 120)
    rate, d = fluid_token_rate([[0.5] + [float(c)] * 30 for c in cadences])
    assert d == pytest.approx(p99(cadences), rel=2e-4)
    assert rate == pytest.approx(1 / p99(cadences), rel=2e-4)


def test_single_token_requests_do_not_count_towards_the_fluid_rate():
    slow = [[0.1] + [c] * 10 for c in (0.05, 0.1, 0.4)]
    with_singles = slow + [[0.3]] * 50
    assert fluid_token_rate(with_singles) == fluid_token_rate(slow)
    assert fluid_token_rate(slow)[1] == pytest.approx(reference_rate(slow)[1], rel=2e-4)
    rate, d = fluid_token_rate([[0.3]] * 5 + [[]])
    assert math.isnan(rate) and math.isnan(d)


def test_tokens_that_all_arrive_with_the_first_are_infinitely_fluid():
    # The whole output in one chunk: no gap to meet, so no deadline is too short.
    assert min_tbt_deadline([0.4, 0.0, 0.0]) == 0.0
    assert fluid_token_rate([[0.4, 0.0, 0.0]] * 3) == (math.inf, 0.0)


def test_fluid_token_rate_subsamples_evenly_above_its_cap():
    # 3000 streams whose cadence rises with their index: an evenly spaced subset of 1000
    # keeps the distribution, so the P99 stays put; the first 1000 alone would not.
    cadences = np.linspace(0.01, 0.3, 3000)
    streams = [[0.2] + [float(c)] * 5 for c in cadences]
    assert FLUID_RATE_MAX_REQUESTS == 1000
    _, d = fluid_token_rate(streams)
    assert d == pytest.approx(p99(cadences), rel=2e-3)
    _, d_small = fluid_token_rate(streams, max_requests=10)
    assert d_small == pytest.approx(p99(cadences[::300]), rel=2e-4)


def test_miss_rate_curve_matches_the_reference():
    rng = np.random.default_rng(15)
    streams = [timeline(rng, exact=False) for _ in range(200)]
    ds = [0.01, 0.03, 0.1, 0.3]
    for q in (0.5, TARGET_QUANTILE):
        want = []
        for d in ds:
            rates = []
            for g in streams:
                m, t = ref_counts(g, 0.0, d, ignore_first=True)
                rates.append(m / t if t else 0.0)
            want.append(float(np.quantile(rates, q)))
        assert miss_rate_curve(streams, ds, q) == pytest.approx(want, rel=1e-12)
    assert miss_rate_curve(streams, ds) == miss_rate_curve(streams, ds, TARGET_QUANTILE)
    assert all(math.isnan(x) for x in miss_rate_curve([], ds))
