"""The control plane of a served disaggregated deployment (``fluidserve serve --disaggregate``).

The HTTP front end holds the request table and talks to one engine-core process per instance
(``EngineCoreClient``, each started in its role by ``fluidserve.disagg.instance``). This
client has the same interface as a single core's, so the front end does not know the
difference:

- a new request goes to the prefill instance with the fewest prompt tokens outstanding;
- each instance's outputs reach the front end as they come (the first token from the
  prefill instance, the rest from the decode instance); the control-plane events among them
  are relayed (``fluidserve.disagg.messages``: hand-off, prefill done, ready to receive,
  received);
- the cluster monitor thread broadcasts the decode instances' loads to the prefill
  instances every ``monitor_interval`` (when they changed);
- an abort reaches every instance that may hold the request; a request that ends with an
  error on one instance is dropped on the others;
- with ``--instance-flip``, the monitor also runs the flip policy (``FlipPolicy``, shared
  with the simulated cluster): it drains an instance (no new prompts for a prefill instance;
  not accepting in the broadcast for a decode instance) and, once no request is held there,
  tells it its new role.

An instance that dies fails the requests it held (with an error the client sees); the others
go on while at least one prefill and one decode instance are alive, else the deployment is
dead (the server turns unhealthy and exits non-zero). KV moves between instances over the
transport chosen with ``--kv-transport`` (torch.distributed gloo, meeting at a store hosted
here, or shared memory), directly from one instance to the other.

The instances are local processes (``--distributed-executor-backend mp``) or Ray actors
placed over a Ray cluster (``ray``: ``fluidserve.disagg.placement``); the front end talks to
both the same way.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable

from fluidserve.config import ConfigError, EngineConfig
from fluidserve.disagg.dispatch import DecodeLoad
from fluidserve.disagg.flip import FlipPolicy
from fluidserve.disagg.instance import InstanceSpec
from fluidserve.disagg.messages import (
    DecodeLoads,
    Handoff,
    KVReceived,
    Migrate,
    PrefillDone,
    Prefilled,
    PrefillLoad,
    ReadyToReceive,
    Redispatch,
    ReleaseKV,
    SendKV,
    SetRole,
)
from fluidserve.engine.core_proc import EngineCoreClient, kill_unless_exited
from fluidserve.engine.messages import (
    AddRequest,
    CoreReady,
    EngineCoreOutputs,
    RequestDelta,
    SchedulerStats,
)
from fluidserve.net import local_store

log = logging.getLogger(__name__)

ROLE_FAULTS = {"kv_send": "prefill", "kv_recv": "decode"}


def check_served(config: EngineConfig) -> None:
    """What a served deployment supports (the simulator covers the rest)."""
    par = config.parallel
    if par.world_size > 1:
        raise ConfigError("--disaggregate runs each instance in one process: tensor and"
                          " pipeline parallelism within an instance are not supported")


class DisaggClient:
    """P prefill and D decode engine-core processes behind one core client's interface."""

    def __init__(self, config: EngineConfig, on_outputs: Callable[[EngineCoreOutputs], None],
                 on_dead: Callable[[str], None], telemetry_file: str | None = None,
                 max_records: int | None = 100_000) -> None:
        check_served(config)
        d = config.disagg
        roles = ["prefill"] * d.num_prefill_instances + ["decode"] * d.num_decode_instances
        if config.model.num_threads is None:  # the instances share this machine's cores
            config = config.replace(num_threads=max(1, (os.cpu_count() or 1) // len(roles)))
        self.config = config
        self.on_outputs, self.on_dead = on_outputs, on_dead
        self.roles = roles
        self.dead: str | None = None
        self.info: CoreReady | None = None
        self._lock = threading.RLock()
        self._alive = set(range(len(roles)))
        self._where: dict[str, set[int]] = {}  # request id -> instances that may hold it
        self._decoder: dict[str, int] = {}  # early hand-off -> its decode instance, until the
        # end of its prefill is relayed
        self.early_handoffs = 0  # requests handed off before their prefill ended
        self._prompt: dict[str, tuple[int, int]] = {}  # request id -> (prefill, tokens) queued
        self._outstanding = [0] * len(roles)  # prompt tokens queued per prefill instance
        self._stats: dict[int, SchedulerStats] = {}
        self._loads: dict[int, DecodeLoad] = {}
        self._undispatched: dict[int, int] = {}  # prefill instance -> requests it holds back
        self._blocks: list[int] = []  # KV blocks per instance
        self._draining: set[int] = set()
        self._flip_policy = FlipPolicy(d) if d.instance_flip else None
        self.flips: list[tuple[float, int, str]] = []  # (monotonic time, instance, new role)
        self.routed = [0] * len(roles)  # requests sent to each instance as a prefill instance
        self._stop = threading.Event()
        self.placement = None
        host = "127.0.0.1"
        if config.parallel.distributed_executor_backend == "ray":
            from fluidserve.disagg.placement import RayPlacement

            self.placement = RayPlacement(len(roles), config.model.num_threads,
                                          same_host=d.kv_transport == "shm")
            host = self.placement.host
        # The instances' KV-transport group meets at a store hosted here (wherever Ray put
        # them, they can reach the front end).
        self._store = None
        if d.kv_transport == "gloo" and host == "127.0.0.1":
            self._store = local_store()  # listening on the loopback interface only
        elif d.kv_transport == "gloo":
            from torch.distributed import TCPStore

            self._store = TCPStore(host, 0, None, True, wait_for_workers=False)
        store = f"{host}:{self._store.port if self._store else 0}"
        session = f"{os.getpid()}-{secrets.token_hex(4)}"
        self.instances: list[EngineCoreClient] = []
        for i, role in enumerate(roles):
            spec = InstanceSpec(i, role, len(roles), store, session)
            tel = f"{telemetry_file}.{role}{i}" if telemetry_file else None
            self.instances.append(EngineCoreClient(
                config, lambda msg, i=i: self._on_instance_outputs(i, msg),
                lambda message, i=i: self._on_instance_dead(i, message), tel, max_records,
                instance=spec, placement=self.placement))

    # ------------------------------------------------------------------ lifecycle
    def wait_ready(self, timeout: float = 600.0) -> CoreReady:
        try:
            infos = [c.wait_ready(timeout) for c in self.instances]
        except BaseException:  # a crash, or a ConfigError: the others must not run on
            self.abandon()
            raise
        self._blocks = [info.num_kv_blocks for info in infos]
        for i, info in enumerate(infos):
            if self.roles[i] == "decode":
                self._loads[i] = DecodeLoad(i, info.num_kv_blocks, 0, 0)
        # A request lives on one instance at a time: what it may use (the front end's
        # admission check) is one instance's cache, not the instances' together.
        self.info = dataclasses.replace(
            infos[0], max_model_len=min(i.max_model_len for i in infos),
            num_kv_blocks=min(i.num_kv_blocks for i in infos),
            load_seconds=max(i.load_seconds for i in infos))
        d = self.config.disagg
        log.info("disaggregated: %d prefill + %d decode instances (%d threads each), KV over"
                 " %s, %s dispatch, %s admission, %s predictor", d.num_prefill_instances,
                 d.num_decode_instances, self.config.model.num_threads, d.kv_transport,
                 d.dispatcher, d.decode_admission, d.length_predictor)
        self._broadcast()
        threading.Thread(target=self._monitor, name="fluidserve-cluster-monitor",
                         daemon=True).start()
        return self.info

    @property
    def proc(self):
        """The first instance's process (what a single-core client exposes)."""
        return self.instances[0].proc

    def shutdown(self, timeout: float = 10.0) -> int | None:
        self._stop.set()
        codes = [c.shutdown(timeout) for c in self.instances]
        self._release()
        bad = [c for c in codes if c != 0]
        return bad[0] if bad else 0

    def abandon(self) -> None:
        """End instances that will not be used (start-up failed): see the core client's."""
        for c in self.instances:
            c.abandon()
        self._release()

    def _release(self) -> None:
        """Give back what the deployment holds besides its instances."""
        if self.placement is not None:
            self.placement.close()
            self.placement = None

    def declare_dead(self, message: str) -> None:
        self._die(message)

    def _die(self, message: str) -> None:
        with self._lock:
            if self.dead is not None:
                return
            self.dead = message
        self._stop.set()
        for c in self.instances:
            kill_unless_exited(c.proc)
        self.on_dead(message)

    # ------------------------------------------------------------------ requests
    def add(self, msg: AddRequest) -> None:
        with self._lock:
            live = [i for i in self._alive if self.roles[i] == "prefill"
                    and i not in self._draining]
            if not live:  # the last one died a moment ago
                self.on_outputs(EngineCoreOutputs([RequestDelta(
                    msg.request_id, [], "error", "no prefill instance is alive",
                    unavailable=True)]))
                return
            target = min(live, key=lambda i: (self._outstanding[i], i))
            n = len(msg.prompt_token_ids)
            self._outstanding[target] += n
            self.routed[target] += 1
            self._prompt[msg.request_id] = (target, n)
            self._where[msg.request_id] = {target}
        self.instances[target].add(msg)

    def abort(self, request_ids: list[str], reason: str = "abort") -> None:
        by_instance: dict[int, list[str]] = {}
        with self._lock:
            for rid in request_ids:
                for i in self._forget(rid):
                    by_instance.setdefault(i, []).append(rid)
                self._prompt_done(rid)
        for i, ids in by_instance.items():
            self.instances[i].abort(ids, reason)

    def fail_all(self, message: str) -> None:
        for i in sorted(self._alive):
            self.instances[i].fail_all(message)

    def force_eos(self, at: set[int]) -> None:
        for c in self.instances:
            c.force_eos(at)

    def inject_fault(self, point: str, times: int = 1, instance: int | None = None) -> None:
        """Testing: ``kv_send`` faults go to the prefill instances, ``kv_recv`` to the decode
        instances, other points to ``instance`` (default: the first)."""
        role = ROLE_FAULTS.get(point)
        targets = [instance] if instance is not None else \
            [i for i, r in enumerate(self.roles) if r == role] if role else [0]
        for i in targets:
            self.instances[i].inject_fault(point, times)

    # ------------------------------------------------------------------ instance outputs
    def _prompt_done(self, rid: str) -> None:
        queued = self._prompt.pop(rid, None)
        if queued is not None:
            self._outstanding[queued[0]] -= queued[1]

    def _on_instance_outputs(self, i: int, msg: EngineCoreOutputs) -> None:
        with self._lock:
            if self.dead is not None:
                return
            drop: dict[int, list[str]] = {}
            for d in msg.outputs:
                rid = d.request_id
                if self.roles[i] == "prefill":
                    self._prompt_done(rid)
                if d.finished:  # ended here: drop it wherever else it is held
                    for j in self._forget(rid):
                        if j != i:
                            drop.setdefault(j, []).append(rid)
            for rid in msg.rejected:
                self._prompt_done(rid)
                self._forget(rid)
            if msg.stats is not None:
                self._stats[i] = msg.stats
                msg.stats = self._total_stats()
            if isinstance(msg.load, PrefillLoad):
                self._undispatched[i] = msg.load.undispatched
            elif isinstance(msg.load, DecodeLoad):
                self._loads[i] = msg.load
            # Every message, for its statistics too (freed blocks are news); the tokens go
            # before the events: a hand-off follows its first token.
            self.on_outputs(msg)
            for e in msg.events:
                self._relay(i, e)
        for j, ids in drop.items():
            self.instances[j].abort(ids)

    def _relay(self, i: int, e) -> None:
        if isinstance(e, Handoff):
            rid = e.request.request_id
            if rid not in self._where:
                return  # ended meanwhile (aborted): the prefill instance freed it
            if e.dst not in self._alive:
                self._fail_request(rid, f"decode instance {e.dst} is gone", unavailable=True)
                return
            if self.roles[e.dst] != "decode":  # it flipped after the dispatcher's last view
                self.instances[i].send(Redispatch(rid))
                return
            self._where[rid].add(e.dst)
            if not e.prefilled:  # its ``PrefillDone`` will follow
                self._decoder[rid] = e.dst
                self.early_handoffs += 1
            self.instances[e.dst].send(Migrate(e.request, e.predicted_len, i, e.prefilled))
        elif isinstance(e, PrefillDone):
            dst = self._decoder.pop(e.request.request_id, None)
            if dst is not None and dst in self._alive:  # else redispatched (or gone)
                self.instances[dst].send(Prefilled(e.request))
        elif isinstance(e, ReadyToReceive):
            if e.src in self._alive:
                self.instances[e.src].send(SendKV(e.request_id, e.dst, e.tags, e.num_blocks,
                                                  e.piece_blocks))
        elif isinstance(e, KVReceived):
            if e.request_id in self._where:
                self._where[e.request_id].discard(e.src)
            if e.src in self._alive:
                self.instances[e.src].send(ReleaseKV(e.request_id))

    def _forget(self, rid: str) -> set[int]:
        """The request has ended: the instances that may still hold it."""
        self._decoder.pop(rid, None)
        return self._where.pop(rid, set())

    def _fail_request(self, rid: str, message: str, unavailable: bool = False) -> None:
        for j in self._forget(rid):
            if j in self._alive:
                self.instances[j].abort([rid])
        self._prompt_done(rid)
        self.on_outputs(EngineCoreOutputs([RequestDelta(rid, [], "error", message,
                                                        unavailable=unavailable)]))

    def _total_stats(self) -> SchedulerStats:
        s = list(self._stats.values())
        return SchedulerStats(
            sum(x.num_running for x in s), sum(x.num_waiting for x in s),
            sum(x.kv_cache_usage for x in s) / len(self.roles),
            sum(x.num_preemptions for x in s), sum(x.num_unfinished for x in s),
            max(x.token_budget for x in s), sum(x.slo_unreachable for x in s))

    def _on_instance_dead(self, i: int, message: str) -> None:
        with self._lock:
            if self.dead is not None or i not in self._alive:
                return
            self._alive.discard(i)
            self._loads.pop(i, None)
            self._stats.pop(i, None)
            what = f"{self.roles[i]} instance {i}: {message}"
            log.error("%s", what)
            left = {self.roles[j] for j in self._alive}
            if not {"prefill", "decode"} <= left:
                fatal = what
            else:
                fatal = None
                for rid in [r for r, where in self._where.items() if i in where]:
                    self._fail_request(rid, what, unavailable=True)
        if fatal is not None:
            self._die(fatal)
        else:
            self._broadcast()

    # ------------------------------------------------------------------ cluster monitor
    def _broadcast(self) -> None:
        """Every interval, changed or not: a prefill instance's dispatcher updates its copy as
        it dispatches, and the next broadcast puts it right."""
        with self._lock:
            loads = tuple(dataclasses.replace(x, accepting=x.instance not in self._draining)
                          for x in sorted(self._loads.values(), key=lambda x: x.instance))
            targets = [i for i in self._alive if self.roles[i] == "prefill"]
        for i in targets:
            self.instances[i].send(DecodeLoads(loads))

    def _monitor(self) -> None:
        while not self._stop.wait(self.config.disagg.monitor_interval):
            if self._flip_policy is not None:
                self._balance(time.monotonic())
            self._broadcast()

    # ------------------------------------------------------------------ instance flips
    def _balance(self, now: float) -> None:
        """Drain an instance of the over-provisioned role; flip the drained ones."""
        d = self.config.disagg
        with self._lock:
            if self.dead is not None:
                return
            held = dict.fromkeys(self._alive, 0)
            for where in self._where.values():
                for i in where:
                    if i in held:
                        held[i] += 1
            accepting = {role: [(i, held[i]) for i in sorted(self._alive)
                                if self.roles[i] == role and i not in self._draining]
                         for role in ("prefill", "decode")}
            prefill = [i for i, _ in accepting["prefill"]]
            backlog = sum(self._outstanding[i] for i in prefill) / max(len(prefill), 1)
            decode_short = any(self._undispatched.get(i, 0) for i in self._alive) or any(
                self._loads[i].waiting for i, _ in accepting["decode"] if i in self._loads)
            victim = self._flip_policy.decide(now, backlog / d.prefill_chunk_size,
                                              decode_short, accepting, bool(self._draining))
            if victim is not None:
                log.info("draining %s instance %d to flip it", self.roles[victim], victim)
                self._draining.add(victim)
            for i in [i for i in self._draining if held.get(i) == 0]:
                self._flip(i, now)

    def _flip(self, i: int, now: float) -> None:
        to = "decode" if self.roles[i] == "prefill" else "prefill"
        self.instances[i].send(SetRole(to))
        self.roles[i] = to
        self._draining.discard(i)
        self._outstanding[i] = 0
        self._undispatched.pop(i, None)
        if to == "decode":
            self._loads[i] = DecodeLoad(i, self._blocks[i], 0, 0)
        else:
            self._loads.pop(i, None)
        self.flips.append((now, i, to))
        log.info("instance %d is now a %s instance", i, to)
