"""`fluidserve profile`'s timer: interleaved, shuffled rounds keep points comparable on a
machine whose speed drifts."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from fluidserve.profiler.run import Timer, _point


class DriftingExecutor:
    """Each step costs its tokens, times a slowdown that grows with every step run: a machine
    getting slower over the profile, the case sequential sweeps measure as a trend in the
    points."""

    block_size = 16

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def execute(self, plan):
        tokens = sum(len(c.token_ids) for c in plan.chunks)
        self.calls.append((plan.chunks[0].request_id, tokens))
        return SimpleNamespace(execution_time=tokens * (1 + 0.01 * len(self.calls)))


def _plan(rid: str, n: int):
    from fluidserve.profiler.run import _chunk

    return [_chunk(rid, 0, n, 16, 0)]


def test_rounds_visit_every_point_once_per_round_in_shuffled_order():
    ex = DriftingExecutor()
    points = [[_plan(f"p{i}", 8)] for i in range(6)] + [[_plan("c", 4), _plan("c", 4)]]
    samples = Timer(ex, repeats=4).rounds(points, "test")
    assert [len(s) for s in samples] == [4] * 7  # the warm-up round is not kept
    steps = len(ex.calls)
    assert steps == 5 * 8  # 5 rounds (warm-up + 4) of 6 single steps and one two-step point
    orders = []
    for r in range(5):
        rids = [rid for rid, _ in ex.calls[r * 8:(r + 1) * 8]]
        assert sorted(set(rids)) == sorted({f"p{i}" for i in range(6)} | {"c"})
        orders.append(tuple(dict.fromkeys(rids)))
    assert len(set(orders)) > 1  # shuffled, not one fixed order
    # A multi-step point reports the sum of its steps; all points cost 8 token-units per round.
    for s in samples:
        assert all(8 < x < 8 * 1.5 for x in s)


def test_interleaving_keeps_equal_points_equal_under_drift():
    """Equal-work points measured one after another would differ by the drift across the whole
    sweep (here +60% over 60 steps); interleaved, their medians agree within a round's."""
    ex = DriftingExecutor()
    points = [[_plan(f"p{i}", 8)] for i in range(10)]
    medians = [_point(s)["time_s"] for s in Timer(ex, repeats=5).rounds(points, "test")]
    assert max(medians) / min(medians) < 1.1


def test_point_reports_median_and_spread():
    p = _point([1.0, 3.0, 2.0])
    assert p["time_s"] == 2.0 and p["spread"] == pytest.approx(3.0)
    assert p["samples_s"] == [1.0, 3.0, 2.0]


def test_engine_overhead_times_every_step_at_the_batch_size_it_reports(tiny_model_dir):
    """64 prompts of 200 tokens take several 2048-token prefill steps, in which the first
    admitted already decode: outputs that ended after a few tokens shrank the timed batch
    (97 -> 19 of 128 in the full profile) while the report said 128."""
    from fluidserve.config import ProfileConfig
    from fluidserve.profiler.run import engine_overhead

    out = engine_overhead(str(tiny_model_dir), ProfileConfig(dtype="float32"), 64, 200)
    assert out["running"] == 64 and out["decode_batches"] == [64] * 10
    assert 0 < out["forward_s"] < out["step_s"]


def test_a_stall_timeline_runs_on_a_warmed_engine_and_holds_only_its_requests(tiny_model_dir):
    from fluidserve.config import ProfileConfig
    from fluidserve.profiler.run import QUICK, stall_timeline

    r = stall_timeline(str(tiny_model_dir), ProfileConfig(dtype="float32"), QUICK, "vllm")
    times = r["token_times"]
    assert set(times) == {"d0", "d1", "long"}  # the warm-up request is not in it
    assert min(min(ts) for ts in times.values()) == 0.0  # and does not set its clock
    assert len(times["long"]) == 4 and r["long_arrival_s"] > 0
