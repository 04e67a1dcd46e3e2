"""The simulator: the engine core and its scheduler, a cost-model executor, a virtual clock.

It is the same core that serves requests (``EngineCore.fill`` / ``finish_oldest``): with
``pp`` pipeline stages up to ``pp`` micro-batches are in flight, each scheduled without the
requests still in the pipeline, each stage processes micro-batches in order, and the idle time
of every stage (the pipeline bubbles) is measured.
"""

from __future__ import annotations

import math
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass

from fluidserve.bench.records import RequestRecord
from fluidserve.bench.workload import WorkloadRequest
from fluidserve.config import EngineConfig
from fluidserve.core.scheduler import RequestRejected, RunnerOutput, SchedulerOutput
from fluidserve.engine.budget import cost_model_budget
from fluidserve.engine.core import EngineCore, VirtualClock
from fluidserve.engine.messages import AddRequest
from fluidserve.engine.telemetry import Telemetry
from fluidserve.request import Request
from fluidserve.sampling_params import SamplingParams
from fluidserve.sim.cost_model import CostModel, PlanShape
from fluidserve.sim.shapes import Device, Shape


class CostModelExecutor:
    """The engine's executor contract, with times from a cost model and no weights.

    A batch enters pipeline stage ``s`` when both the batch has left stage ``s - 1`` and stage
    ``s`` is free; the future carries the virtual time the batch leaves the last stage. With
    one stage this is just the iteration time after the submit time."""

    def __init__(self, cost: CostModel, num_blocks: int, block_size: int, max_model_len: int):
        self.cost = cost
        self.num_blocks, self.block_size, self.max_model_len = num_blocks, block_size, max_model_len
        self.depth = cost.pp
        self.clock: VirtualClock | None = None  # set by simulate()
        self.free_at = [0.0] * cost.pp
        self.busy = [0.0] * cost.pp
        self.num_batches = 0  # batches run (the scheduler also numbers the empty plans)

    def submit(self, plan: SchedulerOutput) -> Future:
        start = t = self.clock.now()
        self.num_batches += 1
        stage_times = [self.cost.iteration_time(plan)] if self.depth == 1 \
            else self.cost.stage_times(PlanShape.of(plan))
        for s, dt in enumerate(stage_times):
            t = max(t, self.free_at[s])
            if self.depth > 1:  # stages that share cores slow each other down
                busy = 1 + sum(1 for j, f in enumerate(self.free_at) if j != s and f > t)
                dt *= self.cost.contention(busy)
            t += dt
            self.free_at[s] = t
            self.busy[s] += dt
        fut: Future = Future()
        sampled = {c.request_id: 0 for c in plan.chunks if c.samples}
        fut.set_result(RunnerOutput(sampled, t - start, finish_time=t))
        return fut

    def shutdown(self) -> None:
        pass


def gpu_kv_blocks(shape: Shape, device: Device, tp: int, pp: int, block_size: int,
                  memory_utilization: float = 0.9, reserve_bytes: float = 2e9) -> int:
    """KV blocks per GPU: memory left after this GPU's weights and an activation reserve."""
    weights = shape.params * 2 / (tp * pp)
    free = device.memory_bytes * memory_utilization - weights - reserve_bytes
    per_token = shape.kv_bytes_per_token(2, tp, pp)
    blocks = int(free // (per_token * block_size))
    if blocks < 1:
        raise ValueError(f"{shape.name} does not fit on {tp * pp} x {device.name}: weights need"
                         f" {weights / 1e9:.1f} GB per GPU")
    return blocks


@dataclass
class SimResult:
    records: list[RequestRecord]
    makespan: float
    stage_busy: list[float]
    num_iterations: int
    preemptions: int
    prefix_cache_hit_rate: float | None = None  # (with prefix caching) of the tokens looked up

    @property
    def stage_idle_fraction(self) -> list[float]:
        return [1 - b / self.makespan if self.makespan else 0.0 for b in self.stage_busy]


def simulate(work: list[WorkloadRequest], config: EngineConfig, executor: CostModelExecutor,
             shared_prefix_len: int = 0) -> SimResult:
    """Run the workload through the engine core on a virtual clock: requests join at their
    arrival times, the pipeline is kept full, and the clock moves to the next batch
    completion or the next arrival, whichever comes first.

    A workload has lengths, not text: each request's prompt is made of tokens of its own, but
    for its first ``shared_prefix_len`` (all of a shorter prompt), the same in every request,
    so that prefix caching finds what it would find in a workload of such prompts."""
    clock = VirtualClock()
    executor.clock = clock
    budget = None
    if config.scheduler.token_budget == "auto":
        sc = config.scheduler
        budget = cost_model_budget(executor.cost, sc.tbt_slo, sc.budget_margin, sc.tile_size)
    core = EngineCore(config, executor, clock, Telemetry(max_records=0), emit_outputs=False,
                      budget_policy=budget)
    pending = deque(sorted(work, key=lambda w: w.arrival))
    reqs: dict[int, Request | str] = {}
    while pending or core.has_unfinished():
        _admit(core, pending, reqs, clock.t, shared_prefix_len)
        core.fill()
        next_arrival = pending[0].arrival if pending else math.inf
        if core.in_flight and (core.pipeline_full
                               or core.in_flight[0][1].result().finish_time <= next_arrival):
            core.finish_oldest()
        elif pending:
            clock.t = max(clock.t, next_arrival)
        elif core.has_unfinished():
            raise RuntimeError("simulation stalled: nothing schedulable or in flight")
    records = [_record(w, reqs[w.index]) for w in work]
    bm = core.block_manager
    return SimResult(records, clock.now(), executor.busy, executor.num_batches,
                     core.scheduler.num_preemptions,
                     bm.hits / bm.queries if bm.prefix_caching and bm.queries else None)


def _admit(core: EngineCore, pending: deque, reqs: dict, now: float, shared: int) -> None:
    while pending and pending[0].arrival <= now:
        w = pending.popleft()
        params = SamplingParams(max_tokens=w.output_len, ignore_eos=True, temperature=0.0)
        common = min(shared, w.prompt_len)
        tokens = [1] * common + [2 + w.index] * (w.prompt_len - common)
        try:
            reqs[w.index] = core.add(AddRequest(str(w.index), tokens, params,
                                                arrival_time=w.arrival))
        except RequestRejected as e:
            reqs[w.index] = str(e)


def _record(w: WorkloadRequest, req: Request | str) -> RequestRecord:
    rec = RequestRecord(w.index, w.prompt_len, w.output_len, w.arrival, sent=w.arrival)
    if isinstance(req, str):
        rec.error = req
        return rec
    times = req.token_times
    rec.gaps = [times[0] - w.arrival] + [b - a for a, b in zip(times, times[1:], strict=False)] \
        if times else []
    rec.num_output_tokens = len(times)
    rec.server_prompt_tokens = req.num_prompt_tokens
    if req.first_scheduled_time is not None:
        rec.scheduling_delay = req.first_scheduled_time - w.arrival
    if req.error:
        rec.error = req.error
    return rec
