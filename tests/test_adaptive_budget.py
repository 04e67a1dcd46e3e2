"""--token-budget auto: the largest chunk that keeps each iteration within the TBT SLO,
learned online, following a sudden slow-down, and never starving prefills."""

from __future__ import annotations

from concurrent.futures import Future

import numpy as np
import pytest

from fluidserve.config import ConfigError, EngineConfig
from fluidserve.core.scheduler import RunnerOutput
from fluidserve.core.token_budget import efficient_chunk, largest_chunk
from fluidserve.engine.core import EngineCore, VirtualClock
from fluidserve.engine.messages import AddRequest
from fluidserve.engine.telemetry import Telemetry
from fluidserve.sampling_params import SamplingParams


def linear(per_decode: float, per_token: float, base: float = 0.01):
    return lambda ctxs, chunk, prefix: base + per_decode * len(ctxs) + per_token * chunk


def test_largest_chunk_is_the_largest_that_fits_in_tiles():
    p = linear(0.001, 0.0001)  # 8 decodes + chunk: 0.018 + 1e-4 * chunk
    assert largest_chunk(p, [5] * 8, 0, 0.05, 4096) == (320, True)
    assert largest_chunk(p, [5] * 8, 0, 0.05, 4096, tile=64) == (320, True)
    assert largest_chunk(p, [5] * 8, 0, 0.05, 4096, tile=128) == (256, True)
    assert largest_chunk(p, [5] * 8, 0, 0.05, 200) == (200, True)  # capped
    # Even the decodes alone miss: the smallest chunk that keeps prefills moving.
    assert largest_chunk(p, [5] * 80, 0, 0.05, 4096, min_chunk=16) == (16, False)
    # A cap below one tile still lets prefills move.
    assert largest_chunk(p, [5] * 8, 0, 0.05, 64, tile=128, min_chunk=16) == (16, True)


def staircase(tile: int = 128, per_token: float = 1e-4, per_tile: float = 0.004,
              base: float = 0.01):
    """A device whose time grows with the tokens (decodes and chunk together) and jumps at
    every tile it starts."""
    def predict(ctxs, chunk, prefix):
        n = len(ctxs) + chunk
        return base + per_token * n + per_tile * -(-n // tile)
    return predict


def test_efficient_chunk_ends_the_iteration_on_a_step_of_the_staircase():
    p, decodes = staircase(), [300] * 24
    # 0.3 s fits 2179 tokens: 3 past the 17th tile, which they start.
    largest, ok = largest_chunk(p, decodes, 0, 0.3, 8192)
    assert ok and largest == 2179 - 24
    chosen = efficient_chunk(p, decodes, 0, largest)
    assert chosen == 17 * 128 - 24  # three tokens fewer, one tile less
    assert p(decodes, chosen, 0) < p(decodes, largest, 0)
    assert chosen / p(decodes, chosen, 0) > largest / p(decodes, largest, 0)
    # On a step already: nothing below it is better.
    largest, _ = largest_chunk(p, decodes, 0, 0.35, 8192)
    assert (24 + largest) % 128 == 0 and efficient_chunk(p, decodes, 0, largest) == largest


def test_efficient_chunk_keeps_the_largest_on_a_smooth_device_and_keeps_to_tiles():
    p = linear(0.001, 0.0001)
    assert efficient_chunk(p, [5] * 8, 0, 3000) == 3000
    assert efficient_chunk(p, [5] * 8, 0, 3000, tile=128) == 3000
    # With a tile size the candidates are tile multiples (chunks pay for whole tiles):
    # 1088 tokens start a ninth 128-token step of this device, 1024 do not.
    assert efficient_chunk(staircase(), [], 0, 1088, tile=64) == 1024


def test_auto_budget_prefers_a_chunk_on_a_step_over_one_just_past_it():
    from fluidserve.engine.budget import AdaptiveBudget

    p, decodes = staircase(), [300] * 24
    total = AdaptiveBudget(p, tbt_slo=0.3, margin=0.0)(decodes, 0)
    assert total == 17 * 128  # not the 2179 tokens that fit


class FakeExecutor:
    """Iteration time = base + per_token x tokens x speed; ``speed`` can change mid-run."""

    depth, num_blocks, block_size, max_model_len = 1, 4096, 16, 8192

    def __init__(self, per_token: float, base: float = 0.004) -> None:
        self.per_token, self.base, self.speed = per_token, base, 1.0

    def submit(self, plan):
        t = (self.base + self.per_token * plan.num_tokens) * self.speed
        fut = Future()
        fut.set_result(RunnerOutput({c.request_id: 7 for c in plan.chunks if c.samples}, t))
        return fut

    def shutdown(self) -> None:
        pass


def run(core: EngineCore, ex: FakeExecutor, n: int, slow_at: int | None = None,
        prompt: int = 700, out: int = 40) -> list[tuple[int, float]]:
    """(iteration, time) for every iteration; requests arrive a few at a time."""
    times, added, step = [], 0, 0
    while added < n or core.has_unfinished():
        if added < n and step % 3 == 0:
            core.add(AddRequest(f"r{added}", [5] * prompt,
                                SamplingParams(max_tokens=out, ignore_eos=True, temperature=0)))
            added += 1
        if slow_at is not None and step == slow_at:
            ex.speed = 3.0
        t0 = core.clock.now()
        core.step()
        times.append((step, core.clock.now() - t0))
        step += 1
        assert step < 20_000, "no progress"
    return times


def auto_core(ex: FakeExecutor, slo: float) -> EngineCore:
    cfg = EngineConfig.create(scheduler="sarathi", token_budget="auto", tbt_slo=slo,
                              budget_margin=0.1, max_num_seqs=64)
    return EngineCore(cfg, ex, VirtualClock(), Telemetry(max_records=None))


def test_learned_budget_keeps_iterations_within_the_slo_and_follows_a_slowdown():
    ex = FakeExecutor(per_token=1e-4)  # 0.1 ms per token: 0.05 s SLO allows ~450 tokens
    core = auto_core(ex, 0.05)
    times = run(core, ex, n=60, slow_at=150, out=100)
    before = [t for i, t in times if 40 <= i < 150]
    after = [t for i, t in times if i >= 160]
    assert sum(t <= 0.05 for t in before) / len(before) >= 0.95
    assert sum(t <= 0.05 for t in after) / len(after) >= 0.95
    budgets = [r.token_budget for r in core.telemetry.iterations]
    # The shipped prior (a 2-core AVX2 CPU) is ~40x slower than this device: ~35 iterations
    # of warm-up, then most of the room is used before the slow-down.
    assert min(budgets[40:150]) > 350
    after_budgets = sorted(budgets[160:])
    assert after_budgets[len(after_budgets) // 2] < 150  # and a third of it after
    assert not core.has_unfinished()


class ColdShapeExecutor(FakeExecutor):
    """The first batch of every padded row count takes ``cold`` times as long (oneDNN
    primitives built, lazy first-forward setup), as on the CPU engine."""

    def __init__(self, per_token: float, cold: float) -> None:
        super().__init__(per_token)
        self.cold, self.seen = cold, set()

    def submit(self, plan):
        from fluidserve.model.linear import padded_rows

        fut = super().submit(plan)
        rows = padded_rows(plan.num_tokens)
        if rows not in self.seen:
            self.seen.add(rows)
            fut.result().execution_time *= self.cold
        return fut


def test_first_batches_of_a_shape_do_not_shrink_the_learned_budget():
    ex = ColdShapeExecutor(per_token=1e-4, cold=6.0)
    core = auto_core(ex, 0.05)
    run(core, ex, n=60, out=100)
    model = core._budget_model
    assert model.first_of_shape == len(ex.seen) > 10
    assert model.scatter < 1.2 and 0.8 < model.correction < 1.25
    budgets = [r.token_budget for r in core.telemetry.iterations]
    assert min(budgets[40:150]) > 350  # as much room as on a machine without the setup cost


class PaddedRowsExecutor(FakeExecutor):
    """The CPU engine's cost: a batch costs what its rows padded to ``padded_rows`` cost
    (577 tokens as much as 640)."""

    def __init__(self, per_token: float, pads_rows: bool) -> None:
        super().__init__(per_token)
        self.pads_rows = pads_rows

    def submit(self, plan):
        from fluidserve.model.linear import padded_rows

        fut = super().submit(plan)
        fut.result().execution_time = (self.base + self.per_token
                                       * padded_rows(plan.num_tokens)) * self.speed
        return fut


def test_auto_prices_padded_rows_and_fills_them():
    from fluidserve.model.linear import padded_rows

    def served(pads_rows: bool):
        ex = PaddedRowsExecutor(per_token=1e-4, pads_rows=pads_rows)
        core = auto_core(ex, 0.05)
        times = run(core, ex, n=60, out=100)
        its = [r for r in list(core.telemetry.iterations)[30:] if r.num_prefill_tokens]
        # The budget, not the batch: a batch is smaller where the prompts run out.
        filled = sum(padded_rows(r.token_budget) == r.token_budget for r in its) / len(its)
        within = sum(t <= 0.05 for _, t in times[30:]) / len(times[30:])
        rate = sum(r.num_prefill_tokens for r in its) / sum(r.duration for r in its)
        return core, filled, within, rate

    core, filled, within, rate = served(pads_rows=True)
    assert core._budget_model.token_rows is padded_rows
    assert filled > 0.9 and within >= 0.95
    # Priced on its tokens, the same engine leaves padding unused: rows it pays for and
    # prefills nothing in.
    _, raw_filled, _, raw_rate = served(pads_rows=False)
    assert raw_filled < 0.5 and rate > 1.05 * raw_rate


def test_padded_rows_benchmark_runs_both_pricings(tiny_model_dir):
    """scripts/bench_auto_rows.py at toy size: a JSON line per round and pricing, then the
    medians (the numbers themselves are not checked: a benchmark)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parent.parent / "scripts" / "bench_auto_rows.py"
    out = subprocess.run([sys.executable, str(script), "--model", str(tiny_model_dir),
                          "--requests", "4", "--rounds", "1", "--tbt-slo", "0.5"],
                         capture_output=True, text=True, check=True, timeout=300)
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert [(r["round"], r["pricing"]) for r in rows[:2]] == [(0, "padded"), (0, "tokens")]
    assert set(rows[2]) == {"padded", "tokens"}
    assert all(r["prefill_tok_s"] > 0 and 0 <= r["on_padded_size"] <= 1 for r in rows[:2])


@pytest.mark.parametrize("tile", [128, 256])
def test_auto_with_tiles_above_the_first_trusted_chunk_still_runs_prefills(tile):
    """The learned budget trusts 64 tokens until it has seen an iteration: with a larger
    tile that was 0 tiles, every plan empty, and the engine spun for ever."""
    ex = FakeExecutor(per_token=1e-4)
    cfg = EngineConfig.create(scheduler="sarathi", token_budget="auto", tbt_slo=0.5,
                              tile_size=tile)
    core = EngineCore(cfg, ex, VirtualClock(), Telemetry(max_records=None))
    run(core, ex, n=3, prompt=300, out=4)
    budgets = [r.token_budget for r in core.telemetry.iterations]
    assert budgets[0] == tile and not core.has_unfinished()


def test_unreachable_slo_degrades_to_small_chunks_and_still_finishes_everything():
    ex = FakeExecutor(per_token=1e-3, base=0.02)  # 30 decodes alone: 0.05 s > 0.03 s
    core = auto_core(ex, 0.03)
    run(core, ex, n=40, prompt=300, out=60)
    assert not core.has_unfinished() and core.scheduler.iteration > 0
    assert core.budget.unreachable > 0
    assert core.stats().slo_unreachable == core.budget.unreachable


def test_auto_needs_an_slo_and_a_chunked_hybrid_scheduler():
    with pytest.raises(ConfigError, match="tbt-slo"):
        EngineConfig.create(token_budget="auto")
    with pytest.raises(ConfigError, match="hybrid-batch"):
        EngineConfig.create(token_budget="auto", tbt_slo=0.1, scheduler="vllm")


def test_simulated_auto_meets_the_slo_on_a_gpu_cost_model():
    from fluidserve.bench.workload import WorkloadSpec, build_workload
    from fluidserve.sim.cost_model import GPUCostModel
    from fluidserve.sim.simulate import CostModelExecutor, simulate

    work, _ = build_workload(WorkloadSpec(dataset="sharegpt", num_prompts=150,
                                          request_rate=3.0, max_prompt_len=4096, seed=2))
    cost = GPUCostModel("mistral-7b", "a100")
    cfg = EngineConfig.create(token_budget="auto", tbt_slo=0.1, budget_margin=0.05)
    res = simulate(work, cfg, CostModelExecutor(cost, 20000, 16, 16384))
    gaps = [g for r in res.records for g in r.gaps[1:]]
    assert max(gaps) <= 0.1 + 1e-9 and all(r.num_output_tokens == w.output_len
                                             for r, w in zip(res.records, work, strict=True))


def test_saturation_chunk_stops_where_the_prefill_rate_stops_growing():
    from fluidserve.core.token_budget import saturation_chunk

    # 10 ms fixed + 0.1 ms per token: the rate approaches 10,000 tokens/s.
    lin = linear(0.0, 1e-4, base=0.01)
    n = saturation_chunk(lin, 8192, fraction=0.9)
    rate = n / lin([], n, 0)
    assert rate >= 0.9 * 8192 / lin([], 8192, 0) and n < 8192
    assert (saturation_chunk(lin, 8192, fraction=0.5) < n
            < saturation_chunk(lin, 8192, fraction=0.99))
    # A step (wave quantization): batches past 800 tokens run 25% slower per token.
    step = lambda ctxs, chunk, prefix: 1e-4 * chunk * (1.25 if chunk > 800 else 1.0)  # noqa
    assert saturation_chunk(step, 4096, tile=16, fraction=0.9) <= 800
    assert saturation_chunk(step, 4096, tile=16, fraction=0.9) % 16 == 0


def test_gap_excess_is_a_capped_quantile_of_recent_gaps_over_the_prediction():
    from fluidserve.engine.budget import GapExcess

    g = GapExcess(prior=0.3, cap=0.5, quantile=0.9, window=100, every=1, min_samples=50)
    g.observe(0.2, [0.25] * 40)
    assert g.value == 0.3  # too few samples: the prior holds
    g.observe(0.2, [0.25] * 20 + [5.0] * 5)  # 5 preempted gaps, capped
    assert g.value == pytest.approx(0.05)
    g.observe(0.2, [0.5] * 20)
    assert g.value == pytest.approx(0.3)
    g.observe(0.2, [0.9] * 15)
    assert g.value == pytest.approx(0.5)  # at most the cap
    g.observe(0.4, [0.3] * 100)  # faster than predicted: the window forgets, never < 0
    assert g.value == 0.0


def test_pipelined_auto_learns_the_wait_from_gaps_of_full_micro_batches_only():
    from fluidserve.core.scheduler.output import SchedulerOutput
    from fluidserve.core.token_budget import pass_target
    from fluidserve.engine.budget import AdaptiveBudget

    times = {}
    b = AdaptiveBudget(linear(0.0, 1e-4), 0.5, 0.0, pp=2,
                       predict_plan=lambda plan: times[plan.iteration])
    assert b.learns_gaps and b.target == pytest.approx(pass_target(0.5, 2))  # the worst case
    assert not AdaptiveBudget(linear(0.0, 1e-4), 0.5, 0.0).learns_gaps
    for i in range(64):
        full = i % 2 == 0
        times[i] = 0.4 if full else 0.05
        plan = SchedulerOutput(i, [])
        b.submitted(plan)
        # Full micro-batches see 20 ms of wait; small ones wait behind a full one.
        b.observe_gaps(plan, [0.42] * 10 if full else [0.3] * 10)
    assert b.target == pytest.approx(0.5 - 0.02)
    assert not b._predicted


def test_simulated_pipelined_auto_meets_the_slo_in_micro_batches_no_larger_than_saturation():
    from fluidserve.bench.workload import WorkloadSpec, build_workload
    from fluidserve.engine.budget import cost_model_budget
    from fluidserve.sim.cost_model import GPUCostModel
    from fluidserve.sim.simulate import CostModelExecutor, simulate

    work, _ = build_workload(WorkloadSpec(dataset="sharegpt", num_prompts=120,
                                          request_rate=0.6, max_prompt_len=4096, seed=3))
    cost = GPUCostModel("llama-2-70b", "a40", tp=4, pp=2)
    cfg = EngineConfig.create(token_budget="auto", tbt_slo=0.5, budget_margin=0.02,
                              tensor_parallel_size=4, pipeline_parallel_size=2)
    sizes = []

    class Recording(CostModelExecutor):
        def submit(self, plan):
            sizes.append(plan.num_tokens)
            return super().submit(plan)

    res = simulate(work, cfg, Recording(cost, 20000, 16, 16384))
    gaps = [g for r in res.records for g in r.gaps[1:]]
    assert np.percentile(gaps, 99) <= 0.5
    saturation = cost_model_budget(cost, 0.5, 0.02, 1).saturation()
    assert 256 < saturation < 2048  # this profile's rate steps down past ~768 tokens
    # The chunk stops at saturation (plus the decodes riding along); some reach it.
    assert saturation < max(sizes) <= saturation + 128
    assert all(r.num_output_tokens == w.output_len for r, w in zip(res.records, work, strict=True))


def test_learned_budget_plans_for_the_scatter_of_measured_iteration_times():
    import random

    from fluidserve.engine.budget import OnlineIterationModel

    def fed(noise: float) -> OnlineIterationModel:
        rng = random.Random(1)
        ex = FakeExecutor(per_token=1e-4)
        core = auto_core(ex, 0.05)
        model = core._budget_model
        orig = ex.submit

        def noisy(plan):  # every 10th iteration runs `noise` times slower
            fut = orig(plan)
            res = fut.result()
            if rng.random() < 0.1:
                res.execution_time *= noise
            return fut

        ex.submit = noisy
        run(core, ex, n=40, out=60)
        assert isinstance(model, OnlineIterationModel)
        return core

    quiet, noisy = fed(1.0), fed(1.3)
    assert quiet._budget_model.scatter == pytest.approx(1.0, abs=0.02)
    assert noisy._budget_model.scatter == pytest.approx(1.3, rel=0.05)
    # The noisy engine plans its iterations shorter by that factor.
    assert noisy.budget.target == pytest.approx(quiet.budget.target / noisy._budget_model.scatter,
                                                rel=0.01)


def test_the_scatter_is_that_of_the_iterations_the_slo_binds():
    """A stall of a few ms doubles a 10 ms decode step and barely moves a 100 ms iteration:
    the budget plans for the scatter of the iterations predicted near its target (where the
    window holds enough of them), not for the small steps' (on a 2-core VM those set it at
    1.5 and the iterations stopped well short of the SLO)."""
    from fluidserve.engine.budget import NEAR_MIN, OnlineIterationModel

    rng = np.random.default_rng(0)
    pred = np.tile([0.01, 0.1], 128)
    stalls = np.where(rng.random(256) < 0.1, 0.008, 0.0)  # every tenth iteration stalls 8 ms
    y = pred * rng.uniform(0.99, 1.01, 256) + stalls
    everything = OnlineIterationModel()._scatter(y, pred)
    near = OnlineIterationModel(near=0.05)
    assert everything > 1.7  # (10 + 8) / 10 ms
    assert near._scatter(y, pred) == pytest.approx(1.09, abs=0.02)  # (100 + 8) / 100 ms
    # Too few iterations near the target in the window: all of them count.
    few = pred.copy()
    few[1::2][NEAR_MIN - 8:] = 0.01
    assert near._scatter(y, few) == pytest.approx(OnlineIterationModel()._scatter(y, few))


@pytest.mark.parametrize("chunk", [0, 1, 16])
def test_candidate_and_executed_plan_are_priced_alike(chunk):
    """The budget plans with candidate_features and learns from the executed plan's
    plan_features (the same sums telemetry records): one batch must give one feature row."""
    from fluidserve.core.scheduler.output import ScheduledChunk, SchedulerOutput
    from fluidserve.engine.budget import candidate_features, plan_features

    params = SamplingParams(max_tokens=4)

    def run(rid, start, n, is_decode):
        return ScheduledChunk(rid, start, (7,) * n, (0,), True, params, 0, 0, is_decode)

    ctxs, prefix = [5, 9, 20], 32
    plan = SchedulerOutput(1, [run(f"d{i}", c - 1, 1, True) for i, c in enumerate(ctxs)])
    if chunk:
        plan.chunks.append(run("p", prefix, chunk, False))
    assert plan_features(plan) == candidate_features(ctxs, chunk, prefix)
    singles = ctxs + ([prefix + 1] if chunk == 1 else [])
    w = plan.attention_work
    assert (w.num_single, w.single_ctx_max) == (len(singles), max(singles))


@pytest.mark.parametrize("window,first", [(3, "2"), (0, "4")])
def test_the_engines_queue_window_bounds_how_long_sjf_holds_a_prompt_back(window, first):
    """--queue-window reaches the colocated scheduler: under sjf with windows of three, the
    shortest of the first three arrivals goes first; with one window, the shortest of all."""
    cfg = EngineConfig.create(scheduler="sarathi", token_budget=8, max_num_seqs=1,
                              queue_policy="sjf", queue_window=window)
    core = EngineCore(cfg, FakeExecutor(per_token=1e-4), VirtualClock())
    for i, n in enumerate([30, 20, 10, 25, 5, 15]):
        core.add(AddRequest(str(i), [1] * n, SamplingParams(max_tokens=2)))
    assert core.scheduler.waiting.ordered()[0].request_id == first
    with pytest.raises(ConfigError, match="queue_window"):
        EngineConfig.create(queue_window=-1)


def test_a_fixed_budget_that_stalls_streams_says_once_how_to_bound_it(caplog):
    """Hybrid iterations over STALL_HINT_S under a fixed budget (three here): one warning,
    at the second, naming the adaptive budget; none when iterations are short, none under
    `auto` (whose run has such iterations too)."""
    import logging

    from fluidserve.engine.core import STALL_HINT_S

    def hints(core, ex) -> list[str]:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="fluidserve.engine.core"):
            run(core, ex, n=4, out=20)
        return [r.getMessage() for r in caplog.records if "waited" in r.getMessage()]

    def fixed(per_token: float) -> tuple[EngineCore, FakeExecutor]:
        cfg = EngineConfig.create(scheduler="sarathi", token_budget=512, max_num_seqs=64)
        ex = FakeExecutor(per_token=per_token)
        return EngineCore(cfg, ex, VirtualClock(), Telemetry(max_records=None)), ex

    slow = 2 * STALL_HINT_S / 512  # a full 512-token iteration: twice the threshold
    (msg,) = hints(*fixed(slow))
    assert "--token-budget auto --tbt-slo" in msg and "now 512" in msg
    assert hints(*fixed(1e-4)) == []  # 51 ms iterations
    ex = FakeExecutor(per_token=slow)
    assert hints(auto_core(ex, 1.5), ex) == []


def test_the_stall_hint_waits_for_a_second_slow_hybrid_iteration(caplog):
    """A single slow hybrid iteration (a kernel compiled on first use, say) says nothing; the
    second does; decode-only or prefill-only iterations never count."""
    import logging

    from fluidserve.core.scheduler.output import ScheduledChunk, SchedulerOutput

    cfg = EngineConfig.create(scheduler="sarathi", token_budget=512, max_num_seqs=64)
    core = EngineCore(cfg, FakeExecutor(per_token=1e-4), VirtualClock())
    p = SamplingParams(max_tokens=8)
    decode = ScheduledChunk("d", 40, (5,), (0, 1, 2), True, p, 0, 3, True)
    prefill = ScheduledChunk("p", 0, (5,) * 300, tuple(range(3, 22)), False, p, 0, 0)
    with caplog.at_level(logging.WARNING, logger="fluidserve.engine.core"):
        for chunks in ([decode], [prefill], [decode, prefill]):
            core._hint_stall(SchedulerOutput(1, chunks), 3.0)
        assert not caplog.records
        core._hint_stall(SchedulerOutput(2, [decode, prefill]), 3.0)
    (rec,) = caplog.records
    assert "301 tokens (300 of them prefill) took 3.0 s: the 1 stream(s)" in rec.getMessage()


def test_the_scatter_leaves_one_gap_in_a_hundred_over_the_slo_not_one_iteration():
    """The SLO bounds the 99th percentile of all token gaps. Where the iterations near the
    target end a quarter of the gaps (the decode steps between them the rest, far inside the
    SLO), a slow one in thirty of them is one gap in 120: the budget need not plan every
    iteration for it. Where they end every gap it must; and without gap counts the scatter is
    the near iterations' 99th percentile, as before."""
    from fluidserve.engine.budget import OnlineIterationModel

    rng = np.random.default_rng(0)
    pred = np.tile([0.01, 0.1], 128)
    y = pred * rng.uniform(0.99, 1.01, 256)
    slow = np.flatnonzero(pred == 0.1)[::30]  # one near iteration in thirty, 1.4x
    y[slow] *= 1.4
    model = OnlineIterationModel(near=0.05)
    quarter = np.where(pred == 0.1, 1.0, 3.0)  # decodes ended: near 1 each, small steps 3
    every = np.where(pred == 0.1, 4.0, 0.0)
    assert model._scatter(y, pred, quarter) == pytest.approx(1.01, abs=0.02)
    assert model._scatter(y, pred, every) == pytest.approx(1.4, abs=0.03)
    assert model._scatter(y, pred) == pytest.approx(model._scatter(y, pred, every), abs=0.03)
