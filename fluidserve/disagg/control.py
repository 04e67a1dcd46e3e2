"""The control plane of a disaggregated deployment: routing, hand-offs, loads, flips.

It sits in the HTTP front end, beside one engine core per instance (``instances``: anything
that takes ``add``, ``send`` and ``abort``; ``fluidserve.disagg.client`` starts them as
processes), and sees each instance's outputs and its death:

- a new request goes to the prefill instance with the fewest prompt tokens still to compute
  (as it last reported them, plus the prompts routed there that it has not read yet: the
  measure the simulated cluster routes by);
- the control-plane events among an instance's outputs are relayed
  (``fluidserve.disagg.messages``: hand-off, prefill done, ready to receive, received); a
  hand-off to a decode instance that died or flipped after the dispatcher's last view goes
  back to its prefill instance, to be dispatched again;
- the decode instances' loads are broadcast to the prefill instances (``_broadcast``);
- an abort reaches every instance that may hold the request; a request that ends with an
  error on one instance is dropped on the others;
- with ``--instance-flip``, ``_balance`` runs the flip policy (``FlipPolicy``, shared with the
  simulated cluster): it drains an instance and, once no request is held there, tells it its
  new role (a KV transfer under way, even of a request that ended meanwhile, counts as
  held at both ends); a role never loses its last instance (a drain is called off when the other
  instance of its role dies).

An instance that dies fails the requests it held (with an error the client sees), except
those a decode instance held whose KV had not all arrived: they are still whole at their
prefill instance, which dispatches them again (``_redispatch``). The others go on while at
least one prefill and one decode instance are alive, else the deployment is dead.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections import deque
from collections.abc import Callable

from fluidserve.config import EngineConfig
from fluidserve.disagg.dispatch import DecodeLoad
from fluidserve.disagg.flip import FlipPolicy
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
from fluidserve.engine.messages import (
    AddRequest,
    EngineCoreOutputs,
    RequestDelta,
    SchedulerStats,
)

log = logging.getLogger(__name__)


REPORTED_KEPT = 100_000  # request ids remembered as reported (the server's ids are unique)


class ControlPlane:
    """Routes requests and relays the hand-off between P prefill and D decode instances."""

    def __init__(self, config: EngineConfig, roles: list[str],
                 on_outputs: Callable[[EngineCoreOutputs], None],
                 on_dead: Callable[[str], None]) -> None:
        d = config.disagg
        self.config = config
        self.on_outputs, self.on_dead = on_outputs, on_dead
        self.roles = list(roles)
        self.dead: str | None = None
        self._lock = threading.RLock()
        self._alive = set(range(len(roles)))
        self._where: dict[str, set[int]] = {}  # request id -> instances that may hold it
        self._decoder: dict[str, int] = {}  # early hand-off -> its decode instance, until the
        # end of its prefill is relayed
        # request id -> (prefill, decode instance) of a KV transfer under way, from the
        # receives posted to their confirmation; kept when the request ends meanwhile (its
        # sender fills the posted receives with zeros): neither end may flip until it is done
        self._transfers: dict[str, tuple[int, int]] = {}
        self.early_handoffs = 0  # requests handed off before their prefill ended
        self.redispatched = 0  # requests whose decode instance died before their KV arrived
        self._queued = [0] * len(roles)  # prompt tokens to compute, as each last reported
        self._unread: list[deque[int]] = [deque() for _ in roles]  # the prompt tokens of the
        # requests routed to each instance that it had not read at its last report
        self._stats: dict[int, SchedulerStats] = {}
        # AddRequests each instance has read (-1: those answered here, no instance alive):
        # every message to the front end carries their sum (``EngineCoreOutputs.adds_seen``)
        self._adds_seen: dict[int, int] = {}
        self._loads: dict[int, DecodeLoad] = {}
        self._undispatched: dict[int, int] = {}  # prefill instance -> requests it holds back
        self._blocks: list[int] = []  # KV blocks per instance
        self._draining: set[int] = set()
        self._flip_policy = FlipPolicy(d) if d.instance_flip else None
        self.flips: list[tuple[float, int, str]] = []  # (monotonic time, instance, new role)
        self.routed = [0] * len(roles)  # requests sent to each instance as a prefill instance
        self._stop = threading.Event()
        # Requests whose telemetry row has gone to the front end, the latest REPORTED_KEPT:
        # an aborted request is ended by every instance that holds it, and each reports it
        self._reported: dict[str, None] = {}
        self.instances: list = []  # set by whoever starts them

    def _die(self, message: str) -> None:
        with self._lock:
            if self.dead is not None:
                return
            self.dead = message
        self._stop.set()
        self._end_instances()
        self.on_dead(message)

    def _end_instances(self) -> None:
        """Stop every instance at once: the deployment is dead (nothing to do here)."""

    # ------------------------------------------------------------------ requests
    def add(self, msg: AddRequest) -> None:
        with self._lock:
            live = [i for i in self._alive if self.roles[i] == "prefill"
                    and i not in self._draining]
            if not live:  # the last one died a moment ago: answered here, as if read
                self._adds_seen[-1] = self._adds_seen.get(-1, 0) + 1
                self.on_outputs(EngineCoreOutputs([RequestDelta(
                    msg.request_id, [], "error", "no prefill instance is alive",
                    unavailable=True)], adds_seen=self._read_count()))
                return
            target = min(live, key=lambda i: (self._outstanding(i), i))
            self._unread[target].append(len(msg.prompt_token_ids))
            self.routed[target] += 1
            self._where[msg.request_id] = {target}
        self.instances[target].add(msg)

    def add_many(self, msgs: list[AddRequest]) -> None:
        """Each to its own prefill instance."""
        for msg in msgs:
            self.add(msg)

    def abort(self, request_ids: list[str], reason: str = "abort") -> None:
        by_instance: dict[int, list[str]] = {}
        with self._lock:
            for rid in request_ids:
                for i in self._forget(rid):
                    by_instance.setdefault(i, []).append(rid)
        for i, ids in by_instance.items():
            self.instances[i].abort(ids, reason)
    # ------------------------------------------------------------------ instance outputs
    def _outstanding(self, i: int) -> int:
        """Prompt tokens prefill instance ``i`` has still to compute."""
        return self._queued[i] + sum(self._unread[i])

    def _on_instance_outputs(self, i: int, msg: EngineCoreOutputs) -> None:
        with self._lock:
            if self.dead is not None:
                return
            drop: dict[int, list[str]] = {}
            for d in msg.outputs:
                rid = d.request_id
                if d.finished:  # ended here: drop it wherever else it is held
                    for j in self._forget(rid):
                        if j != i:
                            drop.setdefault(j, []).append(rid)
            for rid in msg.rejected:
                self._forget(rid)
            if msg.finished:
                msg.finished = self._first_reports(msg.finished)
            self._adds_seen[i] = msg.adds_seen
            msg.adds_seen = self._read_count()
            if msg.stats is not None:
                self._stats[i] = msg.stats
                msg.stats = self._total_stats()
            # A load sent before the instance flipped (its last abort freed blocks) is stale:
            # kept, it would list a prefill instance as an idle decode one for good.
            if isinstance(msg.load, PrefillLoad) and self.roles[i] == "prefill":
                self._undispatched[i] = msg.load.undispatched
                # What it has still to compute of the requests it has read; those it has
                # not read yet count here until it has.
                self._queued[i] = msg.load.queued_tokens
                unread = self._unread[i]
                while len(unread) > self.routed[i] - self._adds_seen[i]:
                    unread.popleft()
            elif isinstance(msg.load, DecodeLoad) and self.roles[i] == "decode":
                self._loads[i] = msg.load
            # Every message, for its statistics too (freed blocks are news); the tokens go
            # before the events: a hand-off follows its first token.
            self.on_outputs(msg)
            for e in msg.events:
                self._relay(i, e)
        for j, ids in drop.items():
            self.instances[j].abort(ids)

    def _first_reports(self, rows: list[dict]) -> list[dict]:
        """The telemetry rows of requests not reported before (the front end counts each
        row as a request that ended: an abort reached both its prefill and decode instance
        counted it twice)."""
        fresh = []
        for row in rows:
            rid = row["request_id"]
            if rid not in self._reported:
                self._reported[rid] = None
                fresh.append(row)
        while len(self._reported) > REPORTED_KEPT:
            del self._reported[next(iter(self._reported))]
        return fresh

    def _relay(self, i: int, e) -> None:
        if isinstance(e, Handoff):
            rid = e.request.request_id
            if rid not in self._where:
                return  # ended meanwhile (aborted): the prefill instance freed it
            # The chosen instance died, or flipped, after the dispatcher's last view: the
            # request is still whole at its prefill instance, which picks again.
            if e.dst not in self._alive or self.roles[e.dst] != "decode":
                self.instances[i].send(Redispatch(rid))
                return
            self._where[rid].add(e.dst)
            if not e.prefilled:  # its ``PrefillDone`` will follow
                self._decoder[rid] = e.dst
                self.early_handoffs += 1
            self.instances[e.dst].send(Migrate(e.request, e.predicted_len, i, e.prefilled,
                                               e.stamp))
        elif isinstance(e, PrefillDone):
            dst = self._decoder.pop(e.request.request_id, None)
            if dst is not None and dst in self._alive:  # else redispatched (or gone)
                self.instances[dst].send(Prefilled(e.request, e.stamp))
        elif isinstance(e, ReadyToReceive):
            if e.dst not in self._alive:  # read after its death: the request went elsewhere
                return
            self._transfers[e.request_id] = (e.src, e.dst)
            if e.src in self._alive:
                self.instances[e.src].send(SendKV(e.request_id, e.dst, e.tags, e.num_blocks,
                                                  e.piece_blocks))
        elif isinstance(e, KVReceived):
            self._transfers.pop(e.request_id, None)
            if e.request_id in self._where:
                self._where[e.request_id].discard(e.src)
            if e.src in self._alive:
                self.instances[e.src].send(ReleaseKV(e.request_id))

    def _redispatch(self, rid: str, dead: int) -> bool:
        """A request whose decode instance died before its KV arrived there is still whole
        at its prefill instance (which frees the blocks only once the receiver confirms):
        that instance dispatches it again, as it does a hand-off to an instance that died
        before the hand-off reached it. Whether it could."""
        where = self._where[rid]
        src = next((j for j in where if j != dead and j in self._alive
                    and self.roles[j] == "prefill"), None)
        if self.roles[dead] != "decode" or src is None:
            return False
        where.discard(dead)
        self._decoder.pop(rid, None)
        self.redispatched += 1
        log.info("request %s goes back to prefill instance %d to be dispatched again", rid, src)
        self.instances[src].send(Redispatch(rid))
        return True

    def _forget(self, rid: str) -> set[int]:
        """The request has ended: the instances that may still hold it."""
        self._decoder.pop(rid, None)
        return self._where.pop(rid, set())

    def _read_count(self) -> int:
        """AddRequests read by the instances, or answered here."""
        return sum(self._adds_seen.values())

    def _fail_request(self, rid: str, message: str, unavailable: bool = False) -> None:
        for j in self._forget(rid):
            if j in self._alive:
                self.instances[j].abort([rid])
        self.on_outputs(EngineCoreOutputs([RequestDelta(rid, [], "error", message,
                                                        unavailable=unavailable)],
                                          adds_seen=self._read_count()))

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
            self._undispatched.pop(i, None)
            self._draining.discard(i)  # else no other instance could ever drain
            for rid in [r for r, ends in self._transfers.items() if i in ends]:
                del self._transfers[rid]  # the other end fails it or times out
            what = f"{self.roles[i]} instance {i}: {message}"
            log.error("%s", what)
            for j in list(self._draining):  # the last of its role now: it stays
                if not self._others_serve(j):
                    log.info("instance %d stays a %s instance: the other one died", j,
                             self.roles[j])
                    self._draining.discard(j)
            left = {self.roles[j] for j in self._alive}
            if not {"prefill", "decode"} <= left:
                fatal = what
            else:
                fatal = None
                for rid in [r for r, where in self._where.items() if i in where]:
                    if not self._redispatch(rid, i):
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

    # ------------------------------------------------------------------ instance flips
    def _balance(self, now: float) -> None:
        """Drain an instance of the over-provisioned role; flip the drained ones."""
        d = self.config.disagg
        with self._lock:
            if self.dead is not None:
                return
            held = dict.fromkeys(self._alive, 0)
            for where in [*self._where.values(), *self._transfers.values()]:
                for i in where:
                    if i in held:
                        held[i] += 1
            accepting = {role: [(i, held[i]) for i in sorted(self._alive)
                                if self.roles[i] == role and i not in self._draining]
                         for role in ("prefill", "decode")}
            prefill = [i for i, _ in accepting["prefill"]]
            backlog = sum(self._outstanding(i) for i in prefill) / max(len(prefill), 1)
            decode_short = any(self._undispatched.get(i, 0) for i in self._alive) or any(
                self._loads[i].waiting for i, _ in accepting["decode"] if i in self._loads)
            victim = self._flip_policy.decide(now, backlog / d.prefill_chunk_size,
                                              decode_short, accepting, bool(self._draining))
            if victim is not None:
                log.info("draining %s instance %d to flip it", self.roles[victim], victim)
                self._draining.add(victim)
            for i in [i for i in self._draining if held.get(i) == 0]:
                if self._others_serve(i):
                    self._flip(i, now)
                else:  # an instance of its role died meanwhile
                    self._draining.discard(i)

    def _others_serve(self, i: int) -> bool:
        """Whether an instance besides ``i`` serves its role (alive, not draining)."""
        return any(j != i and j not in self._draining and self.roles[j] == self.roles[i]
                   for j in self._alive)

    def _flip(self, i: int, now: float) -> None:
        to = "decode" if self.roles[i] == "prefill" else "prefill"
        self.instances[i].send(SetRole(to))
        self.roles[i] = to
        self._draining.discard(i)
        self._queued[i] = 0
        self._undispatched.pop(i, None)
        if to == "decode":
            self._loads[i] = DecodeLoad(i, self._blocks[i], 0, 0)
        else:
            self._loads.pop(i, None)
        self.flips.append((now, i, to))
        log.info("instance %d is now a %s instance", i, to)
