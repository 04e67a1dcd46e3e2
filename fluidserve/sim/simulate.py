"""The simulator: the real engine loop and scheduler, a cost-model executor, a virtual clock.

With one pipeline stage the loop is ``LLMEngine.step`` itself. With ``pp`` stages up to
``pp`` micro-batches are in flight: a new one is scheduled (excluding requests still in the
pipeline) as soon as a slot frees, each stage processes micro-batches in order, and the
idle time of every stage (the pipeline bubbles) is measured.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from fluidserve.bench.client import RequestRecord
from fluidserve.bench.workload import WorkloadRequest
from fluidserve.config import EngineConfig
from fluidserve.core.scheduler import RequestRejected, RunnerOutput, SchedulerOutput
from fluidserve.engine.engine import LLMEngine, VirtualClock
from fluidserve.engine.telemetry import Telemetry
from fluidserve.request import Request
from fluidserve.sampling_params import SamplingParams
from fluidserve.sim.cost_model import CostModel, PlanShape
from fluidserve.sim.shapes import Device, Shape


class CostModelExecutor:
    """Executor contract of the engine, with times from a cost model and no weights."""

    def __init__(self, cost: CostModel, num_blocks: int, block_size: int, max_model_len: int):
        self.cost = cost
        self.num_blocks, self.block_size, self.max_model_len = num_blocks, block_size, max_model_len

    def execute(self, plan: SchedulerOutput) -> RunnerOutput:
        sampled = {c.request_id: 0 for c in plan.chunks if c.samples}
        return RunnerOutput(sampled, self.cost.iteration_time(plan))


def gpu_kv_blocks(shape: Shape, device: Device, tp: int, pp: int, block_size: int,
                  memory_utilization: float = 0.9, reserve_bytes: float = 2e9) -> int:
    """KV blocks per GPU: memory left after this GPU's weights and an activation reserve."""
    weights = shape.params * 2 / (tp * pp)
    free = device.memory_bytes * memory_utilization - weights - reserve_bytes
    per_token = 2 * (shape.layers / pp) * max(1.0, shape.kv_heads / tp) * shape.head_dim * 2
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

    @property
    def stage_idle_fraction(self) -> list[float]:
        return [1 - b / self.makespan if self.makespan else 0.0 for b in self.stage_busy]


def simulate(work: list[WorkloadRequest], config: EngineConfig, executor: CostModelExecutor
             ) -> SimResult:
    eng = LLMEngine(config, executor=executor, clock=VirtualClock(),
                    telemetry=Telemetry(max_records=0), emit_outputs=False)
    pending = deque(sorted(work, key=lambda w: w.arrival))
    reqs: dict[int, Request | str] = {}
    if executor.cost.pp == 1:
        busy = _run_serial(eng, pending, reqs)
    else:
        busy = _run_pipelined(eng, pending, reqs, executor.cost)
    records = [_record(w, reqs[w.index]) for w in work]
    return SimResult(records, eng.clock.now(), busy, eng.scheduler.iteration,
                     eng.scheduler.num_preemptions)


def _admit(eng: LLMEngine, pending: deque, reqs: dict, now: float) -> None:
    while pending and pending[0].arrival <= now:
        w = pending.popleft()
        params = SamplingParams(max_tokens=w.output_len, ignore_eos=True, temperature=0.0)
        try:
            reqs[w.index] = eng.add_request(str(w.index), [1] * w.prompt_len, params, w.arrival)
        except RequestRejected as e:
            reqs[w.index] = str(e)


def _run_serial(eng: LLMEngine, pending: deque, reqs: dict) -> list[float]:
    busy = 0.0
    while pending or eng.has_unfinished():
        _admit(eng, pending, reqs, eng.clock.now())
        if not eng.has_unfinished():
            eng.clock.t = max(eng.clock.t, pending[0].arrival)
            continue
        start = eng.clock.now()
        eng.step()
        busy += eng.clock.now() - start
    return [busy]


def _run_pipelined(eng: LLMEngine, pending: deque, reqs: dict, cost: CostModel) -> list[float]:
    pp, clock = cost.pp, eng.clock
    free_at, busy = [0.0] * pp, [0.0] * pp
    flight: deque[tuple[float, float, SchedulerOutput]] = deque()  # (finish, start, plan)
    while pending or eng.has_unfinished():
        _admit(eng, pending, reqs, clock.t)
        while len(flight) < pp:
            in_flight = frozenset(c.request_id for _, _, p in flight for c in p.chunks)
            plan = eng.scheduler.schedule(clock.t, in_flight)
            if plan.is_empty:
                break
            t = clock.t
            for s, dt in enumerate(cost.stage_times(PlanShape.of(plan))):
                t = max(t, free_at[s]) + dt
                free_at[s] = t
                busy[s] += dt
            flight.append((t, clock.t, plan))
        next_arrival = pending[0].arrival if pending else math.inf
        if flight and (len(flight) == pp or flight[0][0] <= next_arrival):
            finish, start, plan = flight.popleft()
            clock.t = max(clock.t, finish)
            sampled = {c.request_id: 0 for c in plan.chunks if c.samples}
            eng.complete(plan, RunnerOutput(sampled, finish - start), start, finish)
        elif pending:
            clock.t = max(clock.t, next_arrival)
        elif eng.has_unfinished():
            raise RuntimeError("pipeline simulation stalled: nothing schedulable or in flight")
    return busy


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
