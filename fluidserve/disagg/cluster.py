"""TetriInfer's control plane over prefill and decode instances, on per-instance clocks.

Each instance is an ``EngineCore`` in a role (``prefill`` or ``decode``) with its own
executor and its own virtual clock, which moves by the execution times its executor reports:
measured times for a real model, cost-model times in simulation. The cluster is a
discrete-event loop over those clocks: it always advances the instance (or event) that is
earliest. A control-plane decision at time t (a dispatch, an admission) reads an instance
whose clock may be ahead of t by up to one iteration: the state it has scheduled from.

A request's life: it arrives at the front end and goes to the prefill instance with the
least prefill work queued; that instance prefills it in fixed-size chunks and samples its
first token; the length predictor buckets its generated length; the dispatcher picks a
decode instance from the monitor's last broadcast; the decode instance admits it by its
admission policy, reserving KV blocks; the KV moves (``KVMover``), which takes the transfer
time; then the prefill instance frees its blocks and the decode instance decodes it to the
end. With chunk-level KV transfer the hand-off starts at the first chunk, as served: the
decode instance admits (and holds blocks for) the request while it is still prefilling, the
KV streams from the admission on, and what is left when the prefill ends (at least the last
chunk) is on the critical path. The cluster monitor broadcasts decode loads every
``monitor_interval`` and, with ``instance_flip``, drains an instance of the
over-provisioned role and flips it when the imbalance lasts ``flip_window``.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from fluidserve.config import EngineConfig
from fluidserve.core.block_manager import BlockManager
from fluidserve.core.scheduler.base import RequestRejected, Scheduler, SchedulerLimits
from fluidserve.core.scheduler.disagg import ROLES, role_scheduler_factory
from fluidserve.disagg.dispatch import DecodeLoad, Dispatcher, pick_decode
from fluidserve.disagg.flip import FlipPolicy
from fluidserve.disagg.predictor import make_predictor, predict_length
from fluidserve.engine.core import EngineCore, Executor, VirtualClock
from fluidserve.engine.messages import AddRequest
from fluidserve.engine.telemetry import Telemetry
from fluidserve.request import Request, RequestStatus


class KVMover(Protocol):
    """Moves the KV of ``num_tokens`` tokens between two instances' paged caches."""

    def move(self, src: Executor, dst: Executor, src_blocks: tuple[int, ...],
             dst_blocks: tuple[int, ...], num_tokens: int) -> None: ...


class NoMover:
    """Simulation: there is no data, only the transfer time."""

    def move(self, src, dst, src_blocks, dst_blocks, num_tokens) -> None:
        return None


@dataclass
class Instance:
    index: int
    role: str
    core: EngineCore
    clock: VirtualClock
    base_limits: SchedulerLimits | None = None  # the engine's limits, before the role's
    draining: bool = False
    blocked: bool = False  # has work but could not schedule any: waits for an event
    busy: float = 0.0  # seconds spent computing
    role_time: dict[str, float] = field(default_factory=lambda: {r: 0.0 for r in ROLES})

    @property
    def sched(self) -> Scheduler:
        return self.core.scheduler

    def has_work(self) -> bool:
        return self.sched.has_work()

    def empty(self) -> bool:
        s = self.sched
        return not s.requests and not getattr(s, "incoming", None)


@dataclass
class Flip:
    time: float
    instance: int
    to: str


@dataclass
class ClusterResult:
    requests: dict[str, Request | str]  # a string: why the request was rejected
    makespan: float
    instances: list[Instance]
    flips: list[Flip]
    transfers: int
    transfer_seconds: float

    @property
    def instance_seconds(self) -> float:
        """Resource time: instances x wall time (TetriInfer's cost measure)."""
        return len(self.instances) * self.makespan


class Cluster:
    def __init__(self, config: EngineConfig, make_executor: Callable[[VirtualClock], Executor],
                 kv_bytes_per_token: float, *, bandwidth_gbps: float,
                 mover: KVMover | None = None, seed: int = 0,
                 max_tokens_are_lengths: bool = False) -> None:
        """``make_executor(clock)`` builds one instance's executor; ``kv_bytes_per_token``
        and ``bandwidth_gbps`` give the KV-transfer time (per GPU of an instance: TP and PP
        shards move in parallel over their own links). ``max_tokens_are_lengths``: the
        requests' ``max_tokens`` are their true output lengths (a simulated workload with
        ``ignore_eos``), so predictions are not capped by them: that would hand the
        predictor the answer."""
        self.config = config
        d = config.disagg
        self.d = d
        self.mover = mover or NoMover()
        self.kv_bytes_per_token = kv_bytes_per_token
        self.bandwidth = bandwidth_gbps * 1e9
        self.predictor = make_predictor(d.length_predictor, d.predictor_granularity,
                                        d.predictor_accuracy, seed, d.length_predictor_path)
        # One dispatcher per prefill instance, each with its own view between broadcasts,
        # as served (``PrefillRole``); made when an instance first dispatches.
        self.dispatchers: dict[int, Dispatcher] = {}
        self._seed = seed
        self._cap = not max_tokens_are_lengths
        self.instances: list[Instance] = []
        for role, n in (("prefill", d.num_prefill_instances), ("decode", d.num_decode_instances)):
            for _ in range(n):
                index = len(self.instances)
                clock = VirtualClock()
                ex = make_executor(clock)
                seen: list[SchedulerLimits] = []

                def factory(lim, bm, role=role, seen=seen):
                    seen.append(lim)
                    return self._factory(role)(lim, bm)

                # Each instance draws its own sampling seeds for requests without one.
                cfg = dataclasses.replace(config, model=dataclasses.replace(
                    config.model, seed=config.model.seed + index))
                core = EngineCore(cfg, ex, clock, Telemetry(max_records=0),
                                  emit_outputs=False, scheduler_factory=factory)
                self.instances.append(Instance(index, role, core, clock, seen[0]))
        self._events: list = []
        self._seq = itertools.count()
        self.true_len: dict[str, int] = {}
        self.owner: dict[str, Instance] = {}  # prefill instance holding a request's KV
        self.undispatched: list[tuple[Instance, Request, int]] = []
        self.requests: dict[str, Request] = {}
        self.flips: list[Flip] = []
        self.transfers, self.transfer_seconds = 0, 0.0
        self.flip_policy = FlipPolicy(d)
        self._announced: set[str] = set()
        self._admitted: dict[str, tuple[Instance, float]] = {}  # -> decode instance, when
        self._early: set[str] = set()  # admitted before their prefill ended
        self._streaming: set[str] = set()  # handed off at their first chunk, still prefilling
        self.broadcast()

    # ------------------------------------------------------------------ roles
    def _factory(self, role: str) -> Callable[[SchedulerLimits, BlockManager], Scheduler]:
        return role_scheduler_factory(self.config, role)

    def role_of(self, role: str, *, accepting: bool = False) -> list[Instance]:
        return [i for i in self.instances if i.role == role and not (accepting and i.draining)]

    # ------------------------------------------------------------------ the event loop
    def _push(self, t: float, kind: str, *payload) -> None:
        heapq.heappush(self._events, (t, next(self._seq), kind, payload))

    def run(self, arrivals: list[tuple[float, AddRequest, int]]) -> ClusterResult:
        """Serve ``(arrival time, request, true output length)`` to the end."""
        pending = sorted(arrivals, key=lambda a: a[0])
        pending.reverse()
        next_tick = self.d.monitor_interval
        while True:
            busy = [i for i in self.instances if i.has_work() and not i.blocked]
            inst = min(busy, key=lambda i: (i.clock.t, i.index), default=None)
            t_inst = inst.clock.t if inst else math.inf
            t_evt = self._events[0][0] if self._events else math.inf
            t_arr = pending[-1][0] if pending else math.inf
            t = min(t_inst, t_evt, t_arr)
            if t == math.inf:
                if self.undispatched or any(getattr(i.sched, "incoming", None) or i.blocked
                                            for i in self.instances):
                    # a minute past the last event, and at least one broadcast
                    if next_tick > self._now_max() + 60 + self.d.monitor_interval:
                        raise RuntimeError("cluster stalled: requests wait for KV blocks that"
                                           " no instance can free")
                    self._tick(next_tick)
                    next_tick += self.d.monitor_interval
                    continue
                break
            if next_tick <= t:
                self._tick(next_tick)
                next_tick += self.d.monitor_interval
            elif t_evt <= t:
                _, _, kind, payload = heapq.heappop(self._events)
                getattr(self, f"_on_{kind}")(t_evt, *payload)
            elif t_arr <= t:
                self._arrive(*pending.pop())
            else:
                self._step(inst)
        return ClusterResult(self.requests, self._now_max(), self.instances, self.flips,
                             self.transfers, self.transfer_seconds)

    def _now_max(self) -> float:
        return max(i.clock.t for i in self.instances)

    @staticmethod
    def _wake(inst: Instance, t: float) -> None:
        """An idle or blocked instance's clock catches up with the time something reaches it
        (new work, freed blocks), and it schedules again."""
        if inst.blocked or not inst.has_work():
            inst.clock.t = max(inst.clock.t, t)
        inst.blocked = False
        inst.core.notify()

    def _arrive(self, t: float, msg: AddRequest, true_len: int) -> None:
        target = min(self.role_of("prefill", accepting=True),
                     key=lambda i: (i.sched.queued_prefill_tokens, i.index))
        self._wake(target, t)
        msg = dataclasses.replace(msg, arrival_time=t)
        try:
            req = target.core.add(msg)
        except RequestRejected as e:  # recorded as the request's error, as the server would
            self.requests[msg.request_id] = str(e)
            return
        self.requests[req.request_id] = req
        self.true_len[req.request_id] = true_len

    def _step(self, inst: Instance) -> None:
        t0 = inst.clock.t
        inst.core.step()
        if not inst.core.in_flight and inst.clock.t == t0:
            inst.blocked = True  # nothing ran: it waits for blocks an event will free
            return
        dt = inst.clock.t - t0
        inst.busy += dt
        inst.role_time[inst.role] += dt
        if inst.role == "prefill":
            if self.d.kv_transfer_granularity == "chunk":  # hand off at the first chunk
                for req in inst.sched.running:
                    if req.num_computed_tokens and req.request_id not in self._announced:
                        self._announced.add(req.request_id)
                        self._streaming.add(req.request_id)
                        self._push(inst.clock.t, "prefilled", inst, req)
            for rid, req in inst.sched.handoff.items():
                self._streaming.discard(rid)
                if rid not in self._announced:
                    self._announced.add(rid)
                    self._push(inst.clock.t, "prefilled", inst, req)
                elif rid in self._early:  # admitted while prefilling: the last piece moves
                    self._transfer(rid, inst.clock.t)
            self._drop_ended_streams(inst.clock.t)
        else:
            self._admit(inst, inst.clock.t)

    # ------------------------------------------------------------------ hand-off
    def _on_prefilled(self, t: float, src: Instance, req: Request) -> None:
        if req.status.finished:
            return
        self.owner[req.request_id] = src
        predicted = predict_length(self.predictor, req, self.true_len[req.request_id],
                                   self._cap)
        self._dispatch(t, src, req, predicted)

    def _dispatcher(self, inst: Instance) -> Dispatcher:
        if inst.index not in self.dispatchers:
            self.dispatchers[inst.index] = dsp = Dispatcher(self.d.dispatcher,
                                                            self._seed + inst.index)
            dsp.broadcast(self._loads())
        return self.dispatchers[inst.index]

    def _dispatch(self, t: float, src: Instance, req: Request, predicted: int) -> bool:
        pick = pick_decode(self._dispatcher(src), src.core.block_manager, req, predicted,
                           self.d.heavy_decode_threshold)
        if pick is None:
            self.undispatched.append((src, req, predicted))
            return False
        dst = self.instances[pick]
        dst.sched.offer(req, predicted)
        self._admit(dst, t)
        return True

    def abort(self, request_id: str, t: float) -> None:
        """End a request wherever it is (queued, prefilling, waiting for or in a transfer,
        decoding); its KV blocks are freed on every instance that holds some."""
        req = self.requests.get(request_id)
        if not isinstance(req, Request) or req.status.finished:
            return
        self._end_everywhere(req, RequestStatus.FINISHED_ABORTED, t)
        req.status = RequestStatus.FINISHED_ABORTED
        req.finish_time = t

    def _drop_ended_streams(self, t: float) -> None:
        """A request handed off at its first chunk can end on the prefill instance (its
        first token a stop token, or max_tokens 1) while a decode instance holds an offer
        or blocks for it: those go, or they would be held for good."""
        for rid in [r for r in self._streaming if self.requests[r].status.finished]:
            req = self.requests[rid]
            self._end_everywhere(req, req.status, t)

    def _end_everywhere(self, req: Request, status: RequestStatus, t: float) -> None:
        """Whatever any instance holds of ``req`` (queued, prefilling, an offer, blocks
        reserved or in use) is released, and the hand-off forgets it."""
        rid = req.request_id
        freed = []
        for inst in self.instances:
            if inst.sched.find(rid) is not None:
                inst.sched.finish(req, status, t)
                self._wake(inst, t)
                freed.append(inst)
        self._streaming.discard(rid)
        self._early.discard(rid)
        self._admitted.pop(rid, None)
        self.owner.pop(rid, None)
        self.undispatched = [u for u in self.undispatched if u[1] is not req]
        for inst in freed:  # an idle decode instance admits the offers its blocks now fit
            if inst.role == "decode":
                self._admit(inst, t)

    def _admit(self, dst: Instance, t: float) -> None:
        while (req := dst.sched.admit_next()) is not None:
            rid = req.request_id
            self._admitted[rid] = (dst, t)
            if rid in self.owner and rid in self.owner[rid].sched.handoff:
                self._transfer(rid, t)
            else:  # handed off at its first chunk: the KV streams until the prefill ends
                self._early.add(rid)

    def _transfer(self, rid: str, t: float) -> None:
        """The prefill has ended and the decode instance has admitted the request (the later
        of the two is ``t``): the KV lands after what is left of the transfer."""
        self._early.discard(rid)
        src, (dst, admitted) = self.owner[rid], self._admitted.pop(rid)
        req = src.sched.handoff[rid]
        tokens = req.num_computed_tokens
        self.mover.move(src.core.executor, dst.core.executor, src.core.block_manager.table(rid),
                        dst.core.block_manager.table(rid), tokens)
        every = tokens * self.kv_bytes_per_token / self.bandwidth
        arrive = t + every
        if self.d.kv_transfer_granularity == "chunk":
            # The pieces stream from the admission on as their chunks are computed (the
            # mover copies everything now: only the time differs): what the link has not
            # carried by the end of the prefill, and at least the last chunk, remains.
            chunk = self.d.prefill_chunk_size
            last = (tokens % chunk or min(tokens, chunk)) * self.kv_bytes_per_token \
                / self.bandwidth
            arrive = max(admitted + every, t + last)
        arrive += self.d.kv_transfer_latency
        self.transfers += 1
        self.transfer_seconds += arrive - t
        self._push(arrive, "kv_arrived", src, dst, rid)

    def _on_kv_arrived(self, t: float, src: Instance, dst: Instance, rid: str) -> None:
        if self.owner.get(rid) is not src:  # it ended in transit: both ends freed it then,
            return  # and either may have changed role since
        src.sched.release(rid)
        self._wake(src, t)  # its blocks are free again
        self.owner.pop(rid, None)
        self._wake(dst, t)
        if not dst.sched.activate(rid):  # aborted in transit: its blocks are free again
            self._admit(dst, t)

    # ------------------------------------------------------------------ monitor and flips
    def _loads(self) -> list[DecodeLoad]:
        loads = []
        for inst in self.role_of("decode"):
            heavy, light = inst.sched.heavy_light()
            loads.append(DecodeLoad(inst.index, inst.sched.free_blocks, heavy, light,
                                    accepting=not inst.draining))
        return loads

    def broadcast(self) -> None:
        loads = self._loads()
        for dsp in self.dispatchers.values():
            dsp.broadcast(loads)

    def _tick(self, t: float) -> None:
        self.broadcast()
        waiting, self.undispatched = self.undispatched, []
        for src, req, predicted in waiting:
            if not req.status.finished:
                self._dispatch(t, src, req, predicted)
        for inst in self.role_of("decode"):  # as a served decode instance does every loop
            if inst.sched.incoming:
                self._admit(inst, t)
        if self.d.instance_flip:
            self._balance(t)

    def _balance(self, t: float) -> None:
        d = self.d
        prefill = self.role_of("prefill", accepting=True)
        decode = self.role_of("decode", accepting=True)
        backlog = sum(i.sched.queued_prefill_tokens for i in prefill) / max(len(prefill), 1)
        decode_short = bool(self.undispatched) or any(i.sched.incoming for i in decode)
        victim = self.flip_policy.decide(
            t, backlog / d.prefill_chunk_size, decode_short,
            {role: [(i.index, len(i.sched.requests)) for i in group]
             for role, group in (("prefill", prefill), ("decode", decode))},
            any(i.draining for i in self.instances))
        if victim is not None:
            self.instances[victim].draining = True
        for inst in self.instances:
            if inst.draining and inst.empty():
                self._flip(inst, t)

    def _flip(self, inst: Instance, t: float) -> None:
        to = "decode" if inst.role == "prefill" else "prefill"
        core = inst.core
        core.scheduler = self._factory(to)(inst.base_limits, core.block_manager)
        inst.role, inst.draining = to, False
        inst.clock.t = max(inst.clock.t, t)
        self.flips.append(Flip(t, inst.index, to))
        self.broadcast()
