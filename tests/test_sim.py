"""The simulator: same scheduler code path as the real engine, cost models, pipelines, budget."""

from __future__ import annotations

import dataclasses
import json
import math
from concurrent.futures import Future

import numpy as np
import pytest

from fluidserve.bench.workload import WorkloadRequest, WorkloadSpec, build_workload
from fluidserve.cli import main
from fluidserve.config import EngineConfig
from fluidserve.core.scheduler.output import RunnerOutput
from fluidserve.core.token_budget import find_token_budget
from fluidserve.engine.engine import LLMEngine, VirtualClock
from fluidserve.sampling_params import SamplingParams
from fluidserve.sim.cost_model import (
    SHIPPED_CPU_PROFILES,
    CPUCostModel,
    GPUCostModel,
    PlanShape,
    load_cpu_profile,
    nearest_cpu_profile,
)
from fluidserve.sim.run import reference_batch
from fluidserve.sim.simulate import CostModelExecutor, simulate


class Recording:
    """Wraps an executor: records each batch's composition and reports the cost model's time."""

    depth = 1
    busy = (0.0,)

    def __init__(self, inner, cost) -> None:
        self.inner, self.cost = inner, cost
        self.num_blocks, self.block_size = inner.num_blocks, inner.block_size
        self.max_model_len = inner.max_model_len
        self.arch = getattr(inner, "arch", None)
        self.batches: list[tuple] = []

    def __setattr__(self, name, value):  # simulate() hands its clock to the executor
        if name == "clock" and hasattr(self.inner, "clock"):
            self.inner.clock = value
        super().__setattr__(name, value)

    @property
    def num_batches(self) -> int:
        return self.inner.num_batches

    def submit(self, plan):
        self.batches.append(plan.composition())
        result = self.inner.submit(plan).result()
        fut = Future()
        fut.set_result(RunnerOutput(result.sampled, self.cost.iteration_time(plan),
                                    result.logprobs))
        return fut


def run_engine(eng, work: list[WorkloadRequest], shared: int = 0) -> dict:
    """Serve ``work`` on a real engine as the server's core loop does: requests join between
    iterations once they have arrived; when idle, time jumps to the next arrival; with room
    in the pipeline, a request that arrives before the oldest micro-batch completes starts
    the next micro-batch (``EngineCore.step(wait)``, here on the virtual clock). Prompts are
    tokens of their own but for the first ``shared``, as the simulator makes them."""
    pending, reqs = sorted(work, key=lambda w: w.arrival), {}
    core = eng.core
    while pending or eng.has_unfinished():
        while pending and pending[0].arrival <= eng.clock.now():
            w = pending.pop(0)
            params = SamplingParams(max_tokens=w.output_len, temperature=0.0)
            common = min(shared, w.prompt_len)
            reqs[w.index] = eng.add_request(
                str(w.index), [1] * common + [5 + w.index] * (w.prompt_len - common), params,
                w.arrival)
        if not eng.has_unfinished():
            eng.clock.t = pending[0].arrival
            continue
        core.fill()
        oldest = core.in_flight[0][1].result().finish_time if core.in_flight else None
        if pending and not core.pipeline_full and oldest is not None \
                and pending[0].arrival < oldest:
            eng.clock.t = pending[0].arrival  # step(wait) returns empty-handed meanwhile
            continue
        eng.step()
    return reqs


TIGHT_KV_BLOCKS = 20  # of 8 tokens: 14 prompts of ~60 tokens and their outputs preempt


def engine_under_load(model_dir, scheduler, cost, wrapper, rate, seed, shared=None):
    """The real model under a tight KV cache (preemption), its requests ended by the model's
    EOS at varied lengths, iteration times from ``cost``; returns what the tests compare.
    ``shared``: prefix caching on, over prompts that share their first ``shared`` tokens."""
    from fluidserve.model.runner import ModelExecutor
    from fluidserve.model.tokenizer import Tokenizer

    work, _ = build_workload(WorkloadSpec(dataset="uniform", num_prompts=14, input_len=60,
                                          output_len=24, request_rate=rate, seed=seed))
    rng = np.random.default_rng(seed + 2)
    eos_at = {str(w.index): {int(rng.integers(0, w.output_len + 8))} for w in work}
    cfg = EngineConfig.create(scheduler=scheduler, token_budget=32, block_size=8,
                              max_num_seqs=6, watermark=0.0,
                              enable_prefix_caching=shared is not None)
    model = ModelExecutor(model_dir, block_size=8, num_blocks=TIGHT_KV_BLOCKS)
    real = wrapper(model, cost)
    eng = LLMEngine(cfg, executor=real, tokenizer=Tokenizer(model_dir), clock=VirtualClock())
    real.clock = eng.clock
    eng.core.force_eos_at = eos_at  # the model "says" EOS at a varied index per request
    return work, cfg, model, real, eng, run_engine(eng, work, shared or 0)


@pytest.mark.parametrize("shared", [None, 40])
@pytest.mark.parametrize("arrivals", ["poisson", "at_once"])
@pytest.mark.parametrize("scheduler", ["sarathi", "vllm"])
def test_simulated_batches_equal_real_engine_batches(tiny_model_dir, scheduler, arrivals,
                                                     shared):
    """The real model under a tight KV cache (preemption), with requests ended by the
    model's EOS at varied lengths, against the simulator given those lengths and the same
    iteration times: the same batches, the same token times; with prefix caching too, over
    prompts that share their first 40 tokens."""
    cost = CPUCostModel(load_cpu_profile(None))
    rate = 40.0 if arrivals == "poisson" else math.inf
    work, cfg, model, real, eng, reqs = engine_under_load(tiny_model_dir, scheduler, cost,
                                                          Recording, rate, seed=1,
                                                          shared=shared)
    lengths = [len(reqs[w.index].output_token_ids) for w in work]
    reasons = {reqs[w.index].finish_reason for w in work}
    assert reasons == {"stop", "length"} and len(set(lengths)) > 5  # EOS ended most early
    assert eng.scheduler.num_preemptions > 0
    # The simulator knows no model: it is given the lengths the model produced.
    sim_work = [dataclasses.replace(w, output_len=n) for w, n in zip(work, lengths, strict=True)]
    fake = Recording(CostModelExecutor(cost, TIGHT_KV_BLOCKS, 8, model.max_model_len), cost)
    res = simulate(sim_work, cfg, fake, shared or 0)
    assert fake.batches == real.batches and len(real.batches) > 30
    if shared:
        bm = eng.core.block_manager
        assert bm.hits > 0 and res.prefix_cache_hit_rate == bm.hits / bm.queries
    assert res.preemptions == eng.scheduler.num_preemptions
    for w, rec in zip(work, res.records, strict=True):
        r = reqs[w.index]
        assert rec.num_output_tokens == len(r.output_token_ids)
        assert rec.gaps == [r.token_times[0] - w.arrival] + list(np.diff(r.token_times))
        assert rec.scheduling_delay == r.first_scheduled_time - w.arrival


class PipelinedRecording(Recording):
    """Two batches in flight, timed like a two-stage pipeline: the results come from
    ``inner``, the times from the cost model's stages (a CostModelExecutor on the same clock),
    so the real engine's loop and the simulator's see identical iteration times."""

    depth = 2

    def __init__(self, inner, cost) -> None:
        super().__init__(inner, cost)
        self.timing = CostModelExecutor(cost, inner.num_blocks, inner.block_size,
                                        inner.max_model_len)

    def __setattr__(self, name, value):
        if name == "clock":
            self.timing.clock = value
        super().__setattr__(name, value)

    @property
    def busy(self):
        return self.timing.busy

    def submit(self, plan):
        self.batches.append(plan.composition())
        result = self.inner.submit(plan).result()
        timed = self.timing.submit(plan).result()
        fut = Future()
        fut.set_result(RunnerOutput(result.sampled, timed.execution_time, result.logprobs,
                                    finish_time=timed.finish_time))
        return fut


@pytest.mark.parametrize("scheduler", ["sarathi", "vllm"])
def test_simulated_pipeline_batches_equal_real_engine_batches(tiny_model_dir, scheduler):
    """Two micro-batches in flight (pp = 2 timing), Poisson arrivals, preemption and EOS: the
    engine's loop and the simulator's schedule the same micro-batches at the same times."""
    cost = CPUCostModel(load_cpu_profile(None), pp=2)
    work, cfg, model, real, eng, reqs = engine_under_load(tiny_model_dir, scheduler, cost,
                                                          PipelinedRecording, 40.0, seed=2)
    lengths = [len(reqs[w.index].output_token_ids) for w in work]
    assert eng.scheduler.num_preemptions > 0
    sim_work = [dataclasses.replace(w, output_len=n) for w, n in zip(work, lengths, strict=True)]
    fake = PipelinedRecording(CostModelExecutor(cost, TIGHT_KV_BLOCKS, 8, model.max_model_len),
                              cost)
    res = simulate(sim_work, cfg, fake)
    assert fake.batches == real.batches and len(real.batches) > 30
    assert res.num_iterations == len(fake.batches)  # batches run, not scheduling passes
    for w, rec in zip(work, res.records, strict=True):
        r = reqs[w.index]
        assert rec.gaps == [r.token_times[0] - w.arrival] + list(np.diff(r.token_times))


def test_gpu_cost_model_is_physically_plausible():
    m = GPUCostModel("mistral-7b", "a100")
    assert "Meta-Llama-3-8B" in m.note  # the stand-in table is named
    decode1 = m.iteration_time(reference_batch(1, 1, 512))
    assert 0.006 < decode1 < 0.02  # ~14 GB of weights at ~2 TB/s, plus overheads
    prefill = m.iteration_time(reference_batch(4096, 0, 0))
    assert 0.15 < prefill < 0.8  # ~60 TFLOP at a fraction of 312 TFLOP/s
    times = [m.iteration_time(reference_batch(b, 16, 1024)) for b in (64, 256, 1024, 4096)]
    assert times == sorted(times)
    tp2 = GPUCostModel("mistral-7b", "a100", tp=2)
    assert tp2.iteration_time(reference_batch(2048, 0, 0)) < prefill * 0.75
    assert "stands in" in GPUCostModel("yi-34b", "a100", tp=2).note


def _profile_median(folder: str, op: str, workers: int, per_node: int, size: int) -> float:
    import csv

    from fluidserve.data import data_dir

    with open(data_dir() / "profiles" / "network" / folder / f"{op}.csv") as f:
        times = [float(r[f"time_stats.{op}.median"]) / 1e3 for r in csv.DictReader(f)
                 if (int(r["num_workers"]), int(r["devices_per_node"]), int(r["size"]))
                 == (workers, per_node, size)]
    return float(np.median(times))


def test_network_costs_come_from_the_chosen_layout_never_a_blend_of_layouts():
    """The tables hold one-node (NVLink) and two-node rows for one worker count, 10-100x
    apart: TP all-reduces are one node's, pipeline hops one node's unless the stages are
    placed on nodes of their own."""
    one = GPUCostModel("llama-2-70b", "a100", tp=4, pp=2)
    apart = GPUCostModel("llama-2-70b", "a100", tp=4, pp=2, pipeline_across_nodes=True)
    size = int(one.all_reduce[0][len(one.all_reduce[0]) // 2])
    ar = one._interp(*one.all_reduce, size)
    assert ar == pytest.approx(_profile_median("a100_dgx", "all_reduce", 4, 4, size))
    hop = one._interp(*one.send_recv, size)
    assert hop == pytest.approx(_profile_median("a100_pairwise_nvlink", "send_recv", 2, 2, size))
    from fluidserve.config import ParallelConfig, SimConfig
    from fluidserve.sim.run import make_cost_model

    for sim, pp in ((SimConfig(cost_model="cpu", pipeline_across_nodes=True), 2),
                    (SimConfig(pipeline_across_nodes=True), 1)):  # nothing it could place
        with pytest.raises(ValueError, match="--pipeline-across-nodes places GPU"):
            make_cost_model(sim, ParallelConfig(pipeline_parallel_size=pp))
    far = apart._interp(*apart.send_recv, size)
    assert far == pytest.approx(_profile_median("a100_pairwise_nvlink", "send_recv", 2, 1, size))
    assert far > 5 * hop
    assert apart._interp(*apart.all_reduce, size) == ar
    # Llama-2-70B TP4 prefill of 2048 tokens: ~280 TFLOP over four A100s (312 TFLOP/s each).
    assert 0.25 < GPUCostModel("llama-2-70b", "a100", tp=4).iteration_time(
        reference_batch(2048, 0, 0)) < 0.6


def test_falcon_180b_has_its_own_shape_not_a_gated_llamas():
    from fluidserve.sim.shapes import SHAPES

    falcon, llama = SHAPES["falcon-180b"], SHAPES["llama-2-70b"]
    assert falcon.params == pytest.approx(178.6e9, rel=0.005)  # no MLP gate, tied embeddings
    assert llama.params == pytest.approx(69.0e9, rel=0.005)
    # Its MLP's input projection is priced as one ffn-wide matrix, not two.
    from fluidserve.sim.cost_model import _op_scale

    assert _op_scale("mlp_up_proj", falcon, llama, 1) == pytest.approx(
        14848 * 59392 / (8192 * 2 * 28672))


def test_without_the_shared_data_the_gpu_cost_model_points_to_the_cpu_one(monkeypatch,
                                                                         capsys):
    monkeypatch.setenv("FLUIDSERVE_DATA_DIR", "")  # empty: no data directory
    with pytest.raises(ValueError, match="FLUIDSERVE_DATA_DIR.*--cost-model cpu"):
        GPUCostModel("mistral-7b", "a100")
    assert main(["simulate", "--cost-model", "gpu"]) == 2
    assert "--cost-model cpu" in capsys.readouterr().err


def _prefill(n: int, cached: int = 0) -> PlanShape:
    return PlanShape(n, ((n, cached),) if n > 1 else (), (cached + 1,) if n == 1 else (), 1)


@pytest.mark.parametrize("name", sorted(SHIPPED_CPU_PROFILES))
def test_cpu_cost_model_reproduces_its_profile(name):
    prof = load_cpu_profile(name)
    m = CPUCostModel(prof)
    for p in prof["iteration_time"]:
        assert m.stage_times(_prefill(p["tokens"]))[0] == pytest.approx(p["time_s"], rel=0.15)
    for p in prof["decode"]:
        shape = PlanShape(p["batch_size"], (), (p["context"] + 1,) * p["batch_size"],
                          p["batch_size"])
        assert m.stage_times(shape)[0] == pytest.approx(p["time_s"], rel=0.2)
    for p in prof["chunked_prefill"]:  # chunking a prompt costs more, the smaller the chunks
        c = p["chunk_size"]
        total = sum(m.stage_times(_prefill(c, c * i))[0] for i in range(p["prompt"] // c))
        assert total == pytest.approx(p["time_s"], rel=0.15)
    for p in prof.get("batched_prefill", []):  # k short prompts in one iteration
        k, n = p["prompts"], p["prompt_tokens"]
        shape = PlanShape(k * n, ((n, 0),) * k, (), k)
        assert m.stage_times(shape)[0] == pytest.approx(p["time_s"], rel=0.05)


def test_batched_prompts_in_a_profile_price_attention_apart_from_the_linears():
    """A profile of single prompts alone cannot tell a prompt's per-token work from its
    attention's quadratic work (they grow together): fitted without the batched points, the
    shipped Xeon profile prices 8 prompts of 256 tokens as one of 2048, 10% and more over
    what it measured; with them, the measured saving of batching short prompts is priced."""
    prof = load_cpu_profile("xeon-emr")
    measured = {(p["prompts"], p["prompt_tokens"]): p for p in prof["batched_prefill"]}
    assert measured[(8, 256)]["vs_one_prompt"] < 0.9  # the measured saving
    batch8 = PlanShape(2048, ((256, 0),) * 8, (), 8)
    one = _prefill(2048)
    with_batches = CPUCostModel(prof)
    without = CPUCostModel({k: v for k, v in prof.items() if k != "batched_prefill"})
    assert with_batches.stage_times(batch8)[0] == pytest.approx(measured[(8, 256)]["time_s"],
                                                                rel=0.05)
    assert without.stage_times(batch8)[0] > 1.1 * measured[(8, 256)]["time_s"]
    ratio = with_batches.stage_times(batch8)[0] / with_batches.stage_times(one)[0]
    assert ratio == pytest.approx(measured[(8, 256)]["vs_one_prompt"], abs=0.05)


def test_the_default_cpu_profile_is_the_one_taken_on_this_kind_of_cpu():
    """The engine runs AMX tiles and oneDNN's AMX matmuls where the CPU has AMX, the
    AVX-512 panels on AVX-512 without AMX (with the bf16 dot product on AMD's, the FMA on
    Intel's) and the AVX2 panels on AVX2: each has its shipped profile, and the default is
    the one of this CPU's kind."""
    avx512 = "fpu sse2 avx2 fma avx512f avx512bw avx512_bf16"
    assert nearest_cpu_profile(avx512, "GenuineIntel") == "xeon-emr"
    assert nearest_cpu_profile(avx512, "AuthenticAMD") == "epyc-zen4"
    assert nearest_cpu_profile("avx2 fma avx512f avx512bw", "AuthenticAMD") == "xeon-emr"
    assert nearest_cpu_profile("avx2 fma", "AuthenticAMD") == "epyc-zen3"
    assert nearest_cpu_profile("avx2 fma avx512f avx512bw amx_tile amx_bf16",
                               "GenuineIntel") == "xeon-amx"
    assert load_cpu_profile(None) == load_cpu_profile(nearest_cpu_profile())
    emr, zen3, zen4, amx = (CPUCostModel(load_cpu_profile(n))
                            for n in ("xeon-emr", "epyc-zen3", "epyc-zen4", "xeon-amx"))
    # The Xeon's AVX-512 prefill is about twice the EPYC's AVX2 one, Zen 4's dot product
    # faster again, and the matrix unit's several times faster than any of them.
    assert emr.stage_times(_prefill(512))[0] < 0.7 * zen3.stage_times(_prefill(512))[0]
    assert zen4.stage_times(_prefill(512))[0] < 0.8 * emr.stage_times(_prefill(512))[0]
    assert amx.stage_times(_prefill(512))[0] < 0.4 * zen4.stage_times(_prefill(512))[0]


def _served(base: CPUCostModel, noise=lambda shape, rng: 1.0, n: int = 300,
            spread: bool = True) -> list[dict]:
    """Telemetry of iterations that took twice the profile's prices plus 4 ms per request,
    times ``noise``, decodes at contexts of their own (``spread``; else one per iteration);
    every other record lacks sq_work, as older telemetry files do."""
    rng = np.random.default_rng(0)
    its, t = [], 0.0
    for i in range(n):
        pre = int(rng.choice([0, 0, 0, 40, 200, 700]))
        dec = int(rng.integers(0 if pre else 1, 24))
        ctx = tuple(int(c) for c in rng.integers(20, 900, dec if spread else 1)) * \
            (1 if spread else dec)
        shape = PlanShape(pre + dec, ((pre, 0),) if pre else (), ctx, dec + bool(pre))
        dur = (2 * base.stage_times(shape)[0] + 0.004 * shape_requests(shape)) * noise(shape, rng)
        rec = {"start": t, "duration": dur, "num_prefill_tokens": pre, "num_decode_tokens": dec,
               "num_requests": dec + bool(pre), "num_prefill_requests": int(bool(pre)),
               "prefix_work": 0, "num_single": dec, "single_ctx_max": max(ctx, default=0),
               "single_ctx_sum": sum(ctx)}
        if i % 2:
            rec["sq_work"] = pre * pre
        its.append(rec)
        t += dur
    return its


def test_cpu_cost_model_calibrates_on_served_telemetry():
    base = CPUCostModel(load_cpu_profile(None))
    m = CPUCostModel(load_cpu_profile(None))
    assert m.calibrate([_served(base)]) == 299 and "calibrated on 299" in m.note
    for shape in (_prefill(512), PlanShape(16, (), (300,) * 16, 16),
                  PlanShape(216, ((200, 0),), (400,) * 16, 17)):
        want = 2 * base.stage_times(shape)[0] + 0.004 * shape_requests(shape)
        assert m.stage_times(shape)[0] == pytest.approx(want, rel=0.1)
    with pytest.raises(ValueError, match="at least"):
        CPUCostModel(load_cpu_profile(None)).calibrate([_served(base, n=6)])


def _restart(its: list[dict]) -> None:
    """Each iteration starts where the one before ended (after their durations changed)."""
    t = 0.0
    for rec in its:
        rec["start"], t = t, t + rec["duration"]


def test_cpu_calibration_leaves_out_a_machine_transient():
    """Forty consecutive iterations at 3-5x their price (another tenant on the cores) are
    left out: the prices stay those of the rest of the run, where kept in the fit they raised
    every price (the mean served/fitted ratio). Single slow iterations, as slow, are the
    engine's own variability: they stay, and the jitter replays them."""
    base = CPUCostModel(load_cpu_profile(None))
    clean = CPUCostModel(load_cpu_profile(None))
    clean.calibrate([_served(base)])
    stretch = _served(base)
    for i, rec in enumerate(stretch[100:140]):
        rec["duration"] *= 3 + 2 * (i % 2)
    _restart(stretch)
    m = CPUCostModel(load_cpu_profile(None))
    assert m.calibrate([_served(base), stretch]) < 2 * 299 - 38
    assert "left out" in m.note
    shapes = (_prefill(512), PlanShape(16, (), (300,) * 16, 16),
              PlanShape(216, ((200, 0),), (400,) * 16, 17))
    for shape in shapes:
        assert m.stage_times(shape)[0] == pytest.approx(clean.stage_times(shape)[0], rel=0.05)
    assert max(m.residuals[None]) < 1.5

    scattered = _served(base)
    for rec in scattered[5::10]:
        rec["duration"] *= 4
    _restart(scattered)
    m = CPUCostModel(load_cpu_profile(None))
    assert m.calibrate([scattered]) == 299 and "left out" not in m.note
    assert max(m.residuals[None]) > 2.5


def test_cpu_jitter_replays_served_variability_by_batch_group():
    """Served iterations of big batches vary +-50%, small ones not at all: with jitter the
    simulated times do the same (around the served mean), reproducibly per seed; without it
    they are the fitted time."""
    base = CPUCostModel(load_cpu_profile(None))
    m = CPUCostModel(load_cpu_profile(None))
    m.calibrate([_served(base, lambda s, rng: rng.choice([0.5, 1.5]) if
                          shape_requests(s) >= 12 else 1.0, n=600, spread=False)])
    big, small = PlanShape(16, (), (300,) * 16, 16), PlanShape(4, (), (300,) * 4, 4)
    mean_big = m.stage_times(big)[0]
    m.reseed(0)  # jitter off: reseeding changes nothing
    assert m.stage_times(big)[0] == mean_big
    m.jitter = True
    m.reseed(7)
    draws = [m.stage_times(big)[0] for _ in range(200)]
    m.reseed(7)
    assert [m.stage_times(big)[0] for _ in range(200)] == draws
    served_mean = 2 * base.stage_times(big)[0] + 0.004 * 16  # the noise has mean 1
    assert max(draws) / min(draws) > 2.5 and np.mean(draws) == pytest.approx(served_mean, rel=0.1)
    smalls = [m.stage_times(small)[0] for _ in range(200)]
    assert np.std(smalls) / np.mean(smalls) < np.std(draws) / np.mean(draws) / 3


def shape_requests(s: PlanShape) -> int:
    return len(s.prefills) + len(s.decode_ctx)


def test_pipeline_bubbles_smaller_with_uniform_microbatches():
    work, _ = build_workload(WorkloadSpec(num_prompts=150, request_rate=1.5, seed=2,
                                          max_prompt_len=4096, max_output_len=512))
    idle = {}
    for sched in ("sarathi", "vllm"):
        cost = GPUCostModel("llama-2-70b", "a40", tp=4, pp=2)
        ex = CostModelExecutor(cost, 20000, 16, 8192)
        res = simulate(work, EngineConfig.create(scheduler=sched, token_budget=512), ex)
        assert all(r.ok and r.num_output_tokens == r.output_len for r in res.records)
        assert len(res.stage_busy) == 2
        idle[sched] = max(res.stage_idle_fraction)
    assert idle["sarathi"] < idle["vllm"]


def test_find_token_budget_rounds_to_tiles():
    def t(b):
        return (100 + b) / 1024  # exact in binary

    assert find_token_budget(t, 600 / 1024, tile=1) == (500, 600 / 1024)
    assert find_token_budget(t, 600 / 1024, tile=128)[0] == 384
    assert find_token_budget(t, 0.05, tile=64)[0] == 0
    assert find_token_budget(t, 10.0, tile=1, max_budget=2048)[0] == 2048


def test_simulate_cli_run_budget_and_capacity(tmp_path, capsys):
    base = ["simulate", "--model-shape", "mistral-7b", "--device", "a100", "--trace",
            "sharegpt", "--num-prompts", "120", "--no-plots"]
    assert main([*base, "--request-rate", "2", "--output-dir", str(tmp_path / "run")]) == 0
    s = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert s["simulated"] and s["num_completed"] == 120 and s["tbt_s"]["p99"] > 0
    assert (tmp_path / "run" / "requests.jsonl").is_file()
    assert main(["simulate", "--find-token-budget", "--tbt-slo", "0.1", "--tile-size", "128"]) == 0
    b = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert b["token_budget"] % 128 == 0 and 256 <= b["token_budget"] <= 8192
    assert b["iteration_time_s"] <= 0.1
    # A window shorter than the default reference context: the reference decodes fill it.
    assert main(["simulate", "--find-token-budget", "--max-model-len", "1024"]) == 0
    b = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert b["reference_batch"] == {"decodes": 32, "context": 1023}
    assert main([*base, "--capacity", "--tbt-slo", "0.5", "--max-probes", "6",
                 "--output-dir", str(tmp_path / "cap")]) == 0
    c = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert c["capacity_qps"] > 0 and c["num_probes"] <= 6
    # Each probe's completed requests per second ride along the latency curve.
    assert c["most_served_qps"] == max(p["served_qps"] for p in c["curve"]) > 0
    assert isinstance(c["saturated"], bool)
    assert (c["model_shape"], c["device"], c["pipeline_across_nodes"]) == ("mistral-7b", "a100",
                                                                           False)
    # Simulating this CPU, the summary names no GPU model or device (it once named the
    # defaults of the gpu cost model's knobs).
    assert main(["simulate", "--cost-model", "cpu", "--num-prompts", "20", "--no-plots",
                 "--capacity", "--max-probes", "2", "--output-dir", str(tmp_path / "cpu")]) == 0
    c = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (c["model_shape"], c["device"]) == (None, "this cpu")


def test_cpu_pipeline_stages_share_the_profiled_machines_cores(capsys):
    """Pipeline stages on one CPU share its cores: on the 2-thread profile, 2 or 4 stages
    finish a burst no sooner than one (on a 2-core EPYC, served: 11.1 s, 12.3 s, 12.4 s; the
    stages once simulated as machines of their own, 12.1 s, 6.4 s, 3.7 s). GPU stages have
    GPUs of their own: there a pipeline of two still shortens the burst (0.79x)."""
    def makespan(*args: str) -> float:
        assert main(["simulate", "--input-len", "256", "--output-len", "32", "--num-prompts",
                     "32", "--token-budget", "512", "--no-plots", *args]) == 0
        return json.loads(capsys.readouterr().out.strip().splitlines()[-1])["makespan_s"]

    cpu = ["--cost-model", "cpu", "--cpu-profile", "epyc-zen4"]
    one = makespan(*cpu)
    for pp in ("2", "4"):
        assert makespan(*cpu, "--pipeline-parallel-size", pp) >= 0.95 * one
    gpu = ["--model-shape", "llama-2-70b", "--device", "a100", "--tensor-parallel-size", "4"]
    assert makespan(*gpu, "--pipeline-parallel-size", "2") < 0.85 * makespan(*gpu)
    m = CPUCostModel(load_cpu_profile("epyc-zen4"), pp=2)
    assert (m.threads, m.stage_threads, m.contention(1), m.contention(2)) == (2, 1, 1.0, 1.0)
    assert CPUCostModel(load_cpu_profile("epyc-zen4"), pp=4).contention(4) == 2.0
    # Calibrated on a run with one thread, a stage of one thread runs at that run's pace
    # (scripts/bench_parallel.py's calibration); on the profile's two, at half of it.
    base = CPUCostModel(load_cpu_profile("epyc-zen4"))
    shape = PlanShape(300, ((200, 0),), (400,) * 100, 101)
    for threads, scale in ((1, 1.0), (None, 2.0)):
        m = CPUCostModel(load_cpu_profile("epyc-zen4"), pp=2)
        m.calibrate([_served(base)], threads=threads)
        whole = 2 * base.stage_times(shape)[0] + 0.004 * 101  # what _served's runs took
        assert m.stage_times(shape) == pytest.approx([whole / 2 * scale] * 2, rel=0.05)


def test_the_cpu_cost_model_has_its_models_window():
    """The shipped CPU profiles are of a 4096-token model: simulated with a 16384-token window,
    requests its server refuses were run, priced past the profile."""
    from fluidserve.config import ConfigError, SimConfig

    assert SimConfig(cost_model="cpu").context_window() == 4096
    assert SimConfig().context_window() == 16384  # gpu
    assert SimConfig(cost_model="cpu", max_model_len=2048).context_window() == 2048
    with pytest.raises(ConfigError, match="exceeds the 4096 positions"):
        SimConfig(cost_model="cpu", max_model_len=100000)
    # GPU knobs with the cpu cost model were ignored: a 70B shape gave the 250M model's run.
    with pytest.raises(ConfigError, match="--model-shape, --device: for the gpu cost model"):
        SimConfig(cost_model="cpu", model_shape="llama-2-70b", device="h100")
    with pytest.raises(ConfigError, match="no budget fits the reference batch"):
        SimConfig(find_token_budget=True, max_budget=16, budget_decodes=32)


def test_a_disaggregated_capacity_search_runs(tmp_path, capsys):
    # Its probes read the pipeline's idle fraction, which a cluster has not (KeyError).
    assert main(["simulate", "--disaggregate", "--capacity", "--num-prompts", "20",
                 "--max-probes", "1", "--no-plots", "--output-dir", str(tmp_path)]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["num_probes"] == 1 and out["scheduler"] == "tetriinfer"
    assert out["capacity_qps"] == 1.0 and out["curve"][0]["ok"]


def test_find_token_budget_reports_an_unreachable_slo(capsys):
    rc = main(["simulate", "--cost-model", "cpu", "--find-token-budget", "--tbt-slo", "0.01"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 1 and out["token_budget"] == 0 and "no budget meets it" in out["error"]
    assert main(["simulate", "--cost-model", "cpu", "--find-token-budget", "--tbt-slo", "0.2",
                 "--budget-decodes", "8", "--budget-context", "512"]) == 0
    ok = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert ok["token_budget"] > 8 and ok["iteration_time_s"] <= 0.2 and ok["error"] is None
    # The decodes alone fit, one tile beside them does not: an error, not a budget of 0.
    rc = main(["simulate", "--find-token-budget", "--model-shape", "llama-2-70b", "--device",
               "a40", "--tensor-parallel-size", "4", "--pipeline-parallel-size", "2",
               "--tile-size", "128", "--tbt-slo", "0.135"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 1 and out["token_budget"] == 0 and "one tile (128 tokens)" in out["error"]


def test_a_shipped_cpu_profile_is_chosen_by_name(capsys):
    """--cpu-profile NAME prices with that CPU's shipped profile: the Xeon's faster steps fit
    a larger budget under the same TBT SLO."""
    budgets = {}
    for name in ("epyc-zen3", "xeon-emr"):
        assert main(["simulate", "--cost-model", "cpu", "--cpu-profile", name,
                     "--find-token-budget", "--tbt-slo", "0.2", "--budget-decodes", "8",
                     "--budget-context", "512"]) == 0
        budgets[name] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])[
            "token_budget"]
    assert 0 < budgets["epyc-zen3"] < budgets["xeon-emr"]


def test_cpu_jitter_seed_redraws_iteration_times_of_the_same_workload(tmp_path, capsys):
    """--cpu-jitter-seed (default --seed) draws other served/fitted ratios for the same
    requests: same lengths and arrivals, other token gaps; the same seed repeats exactly."""
    base = CPUCostModel(load_cpu_profile(None))
    tel = tmp_path / "served.jsonl"
    noisy = _served(base, lambda s, rng: rng.choice([0.6, 1.4]), n=400)
    tel.write_text("".join(json.dumps({"type": "iteration", **r}) + "\n" for r in noisy))
    args = ["simulate", "--cost-model", "cpu", "--cpu-calibration", str(tel), "--dataset-name",
            "uniform", "--input-len", "64", "--output-len", "8", "--num-prompts", "12",
            "--request-rate", "2", "--seed", "3", "--no-plots"]

    def run(name, *extra):
        assert main([*args, *extra, "--output-dir", str(tmp_path / name)]) == 0
        capsys.readouterr()
        return [json.loads(x) for x in (tmp_path / name / "requests.jsonl").read_text()
                .splitlines()]

    default, same, other = run("default"), run("same", "--cpu-jitter-seed", "3"), \
        run("other", "--cpu-jitter-seed", "4")
    assert default == same
    key = [(r["prompt_len"], r["output_len"], r["scheduled"]) for r in default]
    assert key == [(r["prompt_len"], r["output_len"], r["scheduled"]) for r in other]
    assert [r["gaps"] for r in default] != [r["gaps"] for r in other]


def test_the_cpu_simulators_cache_is_sized_per_stage_as_the_engines():
    from fluidserve.config import SimConfig
    from fluidserve.model.arch import kv_bytes_per_token
    from fluidserve.model.builder import SHAPES as MODEL_SHAPES
    from fluidserve.sim.run import make_cost_model, make_executor

    def blocks(max_model_len: int = 4096, **kw) -> int:
        sim = SimConfig(cost_model="cpu", max_model_len=max_model_len)
        eng = EngineConfig.create(**kw)
        return make_executor(sim, eng, make_cost_model(sim, eng.parallel)).num_blocks

    m = MODEL_SHAPES["250m"]
    per_token = kv_bytes_per_token(m.num_layers, m.num_kv_heads, m.hidden_size // m.num_heads, 2)
    one = blocks()
    assert one == (1 << 30) // (per_token * 16)  # 1 GiB of the 250M model's KV
    assert blocks(pipeline_parallel_size=2) == 2 * one  # each stage holds half the layers
    # No more than two sequences of 1024 tokens can fill (with the watermark kept free).
    assert 2 * 1024 // 16 <= blocks(1024, max_num_seqs=2) <= 2 * 1024 // 16 + 2


@pytest.mark.parametrize("profile, why", [
    ({"iteration_time": [], "decode": [], "chunked_prefill": []}, "0 timed points"),
    ({"iteration_time": [{"tokens": 1}], "decode": [], "chunked_prefill": []},
     r"iteration_time\[0\] has no time_s"),
    ({"iteration_time": [{"tokens": 1, "time_s": 0}], "decode": [], "chunked_prefill": []},
     r"iteration_time\[0\] has time_s 0 .must be > 0"),
    ({"iteration_time": [], "decode": {"batch_size": 1}, "chunked_prefill": []},
     "decode is not a list"),
])
def test_a_malformed_cpu_profile_is_refused_with_what_is_wrong(tmp_path, profile, why):
    from fluidserve.config import ConfigError
    from fluidserve.sim.cost_model import load_cpu_profile, read_telemetry

    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile))
    with pytest.raises(ConfigError, match=f"--cpu-profile {path}: {why}"):
        load_cpu_profile(str(path))
    tel = tmp_path / "telemetry.jsonl"
    tel.write_text('{"type": "iteration", "start": 1, "duration": 0.9}\n')
    with pytest.raises(ConfigError, match="iteration record 0 has no num_prefill_tokens"):
        read_telemetry([str(tel)])
