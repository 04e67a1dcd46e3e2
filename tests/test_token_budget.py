"""Token budget from a TBT SLO: the binary search against an exhaustive one."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fluidserve.core.token_budget import find_token_budget, round_to_tile


@given(
    steps=st.lists(st.integers(0, 5), min_size=1, max_size=40),
    slo=st.integers(1, 120),
    tile=st.sampled_from([1, 2, 3, 8, 16]),
    max_budget=st.integers(1, 300),
)
def test_find_token_budget_is_the_largest_tile_multiple_within_the_slo(steps, slo, tile,
                                                                      max_budget):
    # A non-decreasing step function of the batch size (plateaus included), in exact units.
    levels = list(itertools.accumulate(steps))

    def batch_time(b: int) -> float:
        return float(levels[min(b // 8, len(levels) - 1)])

    fits = [b for b in range(tile, max_budget + 1, tile) if batch_time(b) <= slo]
    budget, t = find_token_budget(batch_time, float(slo), tile, max_budget)
    assert budget == max(fits, default=0)
    assert t == batch_time(budget if budget else tile)


def test_find_token_budget_defaults_to_tile_1_and_at_most_16384():
    assert find_token_budget(lambda b: b / 1000, 1.001) == (1001, 1.001)
    assert find_token_budget(lambda b: 0.0, 1.0)[0] == 16384


def test_find_token_budget_rejects_a_non_positive_slo():
    with pytest.raises(ValueError, match="^tbt_slo must be > 0$"):
        find_token_budget(lambda b: 1.0, 0.0)


def test_round_to_tile():
    assert [round_to_tile(n, 8) for n in (0, 7, 8, 15, 16)] == [0, 0, 8, 8, 16]
    assert [round_to_tile(n, 2) for n in (5, 6)] == [4, 6]
    assert round_to_tile(13, 1) == 13


def test_pass_target_leaves_room_for_waiting_behind_the_micro_batch_ahead():
    from fluidserve.core.token_budget import pass_target

    assert pass_target(0.3, 1) == 0.3
    assert pass_target(0.3, 0) == 0.3
    assert pass_target(0.3, 2) == pytest.approx(0.2)
    assert pass_target(0.5, 4) == pytest.approx(0.4)


def test_largest_chunk_edges_exact_fits_tiles_and_the_unreachable_case():
    from fluidserve.core.token_budget import largest_chunk

    def ms(ctxs, chunk, prefix):  # 1 ms per decode and per prefill token, exactly
        return (len(ctxs) + chunk) / 1000

    # The answer is the largest chunk that fits, to the token, with the default tile of 1.
    assert largest_chunk(ms, [1] * 10, 0, 0.331, 4096) == (321, True)
    # A chunk that lands exactly on the target fits, also the whole cap.
    assert largest_chunk(ms, [1] * 10, 0, 0.100, 90) == (90, True)
    # Decodes alone exactly on the target: reachable, and nothing more fits.
    assert largest_chunk(ms, [1] * 10, 0, 0.010, 4096) == (1, True)
    assert largest_chunk(ms, [1] * 10, 0, 0.010, 4096, min_chunk=16) == (16, True)
    # In tiles: only whole tiles count; under one tile fits, the minimum chunk is granted.
    assert largest_chunk(ms, [1] * 10, 0, 1.0, 256, tile=64) == (256, True)
    r = largest_chunk(ms, [1] * 10, 0, 0.331, 4096, tile=64)
    assert r == (320, True) and isinstance(r[0], int)
    assert largest_chunk(ms, [1] * 10, 0, 0.050, 4096, tile=64, min_chunk=16) == (16, True)
    # Unreachable: the minimum chunk (1 by default), never more than the cap.
    assert largest_chunk(ms, [1] * 10, 0, 0.009, 4096) == (1, False)
    assert largest_chunk(ms, [1] * 10, 0, 0.009, 4096, min_chunk=16) == (16, False)
    assert largest_chunk(ms, [1] * 10, 0, 0.009, 8, min_chunk=16) == (8, False)
