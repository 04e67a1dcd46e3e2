"""A served prefill or decode instance: an engine-core process in a role.

The instance runs the engine core's loop (``fluidserve.engine.core_proc``) with its role's
scheduler (``role_scheduler_factory``) and a role object that the loop calls between
iterations: it handles the hand-off commands (``fluidserve.disagg.messages``), moves KV over
the transport, and adds its events to the outputs the instance sends to the front end.

- ``PrefillRole``: when a request's prefill ends (its first token is sampled and sent to the
  client as usual), or with chunk-level KV transfer as soon as its first chunk has run, the
  length predictor buckets its output length and the dispatcher picks a decode instance from
  the monitor's last broadcast (``Handoff``; an early one is followed by ``PrefillDone``); on
  ``SendKV`` it sends the request's KV piece by piece, each once its tokens are computed; on
  ``ReleaseKV`` (the receiver confirmed) it frees the blocks.
- ``DecodeRole``: takes ``Migrate``d requests into the decode scheduler's admission queue;
  each admitted request gets its blocks reserved and one receive posted per piece
  (``ReadyToReceive``); each piece that lands is written into its cache; once all have and
  the prefill has ended (``Prefilled`` for an early hand-off) the request decodes from the
  next iteration on, and the instance confirms (``KVReceived``). A transfer that fails or
  makes no progress for ``kv_transfer_timeout`` fails its request with an error the client
  sees.

An instance flip (``SetRole``) replaces the scheduler and the role object of a drained
instance; the model, its KV cache and the transport stay.

Served, the predictor's "true length" is the request's ``max_tokens``: the length it will
generate is unknown until it is generated (the two agree for ``ignore_eos`` requests and a
model that does not stop early).
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass

import torch

from fluidserve.config import EngineConfig
from fluidserve.disagg.cluster import pick_decode, predict_length, role_scheduler_factory
from fluidserve.disagg.dispatch import DecodeLoad, Dispatcher
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
from fluidserve.disagg.predictor import make_predictor
from fluidserve.disagg.transfer import (
    Transfer,
    gather_blocks,
    make_transport,
    num_pieces,
    piece_blocks,
    piece_range,
    scatter_blocks,
    staged_shape,
)
from fluidserve.engine.messages import EngineCoreOutputs, RequestDelta

log = logging.getLogger(__name__)

TRANSFER_POLL_S = 0.001


@dataclass(frozen=True)
class InstanceSpec:
    index: int  # rank in the deployment's KV-transport group
    role: str  # prefill | decode
    world_size: int
    store: str  # host:port of the front end's rendezvous store (gloo transport)
    session: str  # names the deployment's shared-memory segments (shm transport)


def start_instance(config: EngineConfig, spec: InstanceSpec, max_records: int | None):
    """Load the model, build the core in its role, join the KV transport."""
    from fluidserve.engine.core_proc import _start_core

    limits = []
    make = role_scheduler_factory(config, spec.role)

    def factory(lim, bm):
        limits.append(lim)  # kept for a flip: the next role's scheduler starts from them
        return make(lim, bm)

    core = _start_core(config.replace(seed=config.model.seed + spec.index), max_records,
                       factory)
    transport = make_transport(config.disagg.kv_transport, spec.index, spec.world_size,
                               spec.store, spec.session)
    return core, Instance(core, spec, transport, config, limits[0])


class Instance:
    """What the core's loop calls between iterations: the current role, which an instance
    flip (``SetRole``, sent once the control plane has drained the instance) replaces."""

    def __init__(self, core, spec: InstanceSpec, transport, config: EngineConfig,
                 base_limits) -> None:
        self.core, self.index, self.transport, self.config = core, spec.index, transport, config
        self.base_limits = base_limits  # the engine's, before the role's
        self.role = ROLES[spec.role](core, spec.index, transport, config)

    def handle(self, msg) -> bool:
        if isinstance(msg, SetRole):
            self._flip(msg.role)
            return True
        return self.role.handle(msg)

    def poll_interval(self, idle: float) -> float:
        return self.role.poll_interval(idle)

    def poll(self) -> list[RequestDelta]:
        return self.role.poll()

    def annotate(self, out: EngineCoreOutputs) -> bool:
        return self.role.annotate(out)

    def close(self) -> None:
        self.transport.close()

    def _flip(self, to: str) -> None:
        core, old = self.core, self.role
        left = list(core.scheduler.requests) + [
            i.req.request_id for i in getattr(core.scheduler, "incoming", ())]
        if left:  # the control plane flips only drained instances: never silently lose one
            log.error("flipping to %s with %d requests left: failing them", to, len(left))
            old.deltas += core.fail(left, f"instance {self.index} changed role")
        core.scheduler = role_scheduler_factory(self.config, to)(self.base_limits,
                                                                 core.block_manager)
        core.notify()
        self.role = ROLES[to](core, self.index, self.transport, self.config)
        self.role.events, self.role.deltas, self.role.changed = old.events, old.deltas, True
        log.info("instance %d is now a %s instance", self.index, to)


class _Role:
    def __init__(self, core, index: int, transport, config: EngineConfig) -> None:
        self.core, self.index, self.transport = core, index, transport
        self.d = config.disagg
        self.events: list = []
        self.deltas: list[RequestDelta] = []  # requests this role failed
        self.changed = False
        self._load = None  # the load last reported

    def poll_interval(self, idle: float) -> float:
        return idle

    def poll(self) -> list[RequestDelta]:
        deltas, self.deltas = self.deltas, []
        return deltas

    def load(self):
        """What the control plane needs to know of this instance's load."""
        raise NotImplementedError

    def annotate(self, out: EngineCoreOutputs) -> bool:
        """Add this role's events and load to ``out``; True if they (or changed statistics)
        must be sent even with no tokens."""
        load = self.load()
        changed = self.changed or load != self._load
        self._load = out.load = load
        out.events, self.events = self.events, []
        self.changed = False
        return bool(out.events) or changed

    def _fail(self, request_id: str, message: str) -> None:
        log.error("request %s: %s", request_id, message)
        self.deltas += self.core.fail([request_id], message)


@dataclass
class _Stream:
    """A request's KV on its way out: the pieces not yet sent."""

    dst: int
    tags: tuple[int, ...]
    num_blocks: int
    piece_blocks: int
    next: int = 0  # the next piece to send


class PrefillRole(_Role):
    def __init__(self, core, index: int, transport, config: EngineConfig) -> None:
        super().__init__(core, index, transport, config)
        d = self.d
        self.predictor = make_predictor(d.length_predictor, d.predictor_granularity,
                                        d.predictor_accuracy, config.model.seed,
                                        d.length_predictor_path)
        self.dispatcher = Dispatcher(d.dispatcher, config.model.seed + index)
        self.early = d.kv_transfer_granularity == "chunk"  # dispatch at the first chunk
        self.announced: set[str] = set()
        self.undispatched: dict[str, int] = {}  # request id -> predicted length
        self.prefilling: set[str] = set()  # handed off before their prefill ended
        self.streams: dict[str, _Stream] = {}
        self.sending: list[Transfer] = []  # kept until landed: their tensors must live

    def poll_interval(self, idle: float) -> float:
        return TRANSFER_POLL_S if self.sending or self.streams else idle

    def handle(self, msg) -> bool:
        sched = self.core.scheduler
        if isinstance(msg, DecodeLoads):
            self.dispatcher.broadcast(list(msg.loads))
            for rid, predicted in list(self.undispatched.items()):
                req = sched.requests.get(rid)
                if req is None or req.status.finished or self._dispatch(req, predicted):
                    del self.undispatched[rid]
        elif isinstance(msg, Redispatch):
            req = sched.requests.get(msg.request_id)
            if req is not None and not req.status.finished:
                self.prefilling.discard(req.request_id)  # the next hand-off says how far
                self.undispatched[req.request_id] = predict_length(
                    self.predictor, req, req.params.max_tokens)
                self.changed = True
        elif isinstance(msg, SendKV):
            try:
                self.core.trip("kv_send")
            except Exception as e:
                self._fail(msg.request_id, f"KV transfer to instance {msg.dst} failed:"
                           f" {type(e).__name__}: {e}")
            self.streams[msg.request_id] = _Stream(msg.dst, msg.tags, msg.num_blocks,
                                                   msg.piece_blocks)
            self._pump()
        elif isinstance(msg, ReleaseKV):
            sched.release(msg.request_id)
            self.announced.discard(msg.request_id)
            self.core.notify()
            self.changed = True  # report the freed blocks
        else:
            return False
        return True

    def _pump(self) -> None:
        """Send every piece whose tokens are computed. A request that ended here (aborted,
        failed) sends zeros of the size the receiver posted for, so that its receives
        complete (it discards them)."""
        core = self.core
        kv = core.executor.kv_caches
        for rid, st in list(self.streams.items()):
            req = core.scheduler.requests.get(rid)
            ended = req is None or req.status.finished
            pieces = num_pieces(st.num_blocks, st.piece_blocks)
            try:
                while st.next < pieces:
                    blocks = piece_range(st.next, st.piece_blocks, st.num_blocks)
                    if ended:
                        t = torch.zeros(staged_shape(kv, len(blocks)), dtype=kv[0][0].dtype)
                    elif min(blocks.stop * core.block_manager.block_size,
                             req.num_prompt_tokens) > req.num_computed_tokens:
                        break  # its last token is not computed yet
                    else:
                        table = core.block_manager.table(rid)
                        t = gather_blocks(kv, [table[b] for b in blocks])
                    self.sending.append(self.transport.send(t, st.dst, st.tags[st.next]))
                    st.next += 1
            except Exception as e:  # the request fails here, and the front end drops it there
                if ended:
                    log.exception("sending filler KV for %s failed", rid)
                    st.next = pieces
                else:
                    self._fail(rid, f"KV transfer to instance {st.dst} failed:"
                               f" {type(e).__name__}: {e}")
            if st.next == pieces:
                del self.streams[rid]

    def poll(self) -> list[RequestDelta]:
        if self.streams:
            self._pump()
        still = []
        for t in self.sending:
            try:
                if not t.done():
                    still.append(t)
            except Exception:  # the receiver's side fails the request (or times out)
                log.exception("a KV send failed")
        self.sending = still
        return super().poll()

    def annotate(self, out: EngineCoreOutputs) -> bool:
        sched = self.core.scheduler
        handoff = sched.handoff
        if self.early:  # requests whose first chunk has run
            for req in sched.running:
                if req.num_computed_tokens and req.request_id not in self.announced:
                    self._announce(req)
        for rid, req in handoff.items():
            if rid not in self.announced:
                self._announce(req)
            elif rid in self.prefilling:
                self.prefilling.discard(rid)
                self.events.append(PrefillDone(req))
        if len(self.announced) > len(sched.requests):  # some ended here
            self.announced &= sched.requests.keys()
            self.prefilling &= self.announced
        return super().annotate(out)

    def _announce(self, req) -> None:
        self.announced.add(req.request_id)
        predicted = predict_length(self.predictor, req, req.params.max_tokens)
        if not self._dispatch(req, predicted):
            self.undispatched[req.request_id] = predicted

    def load(self) -> PrefillLoad:
        return PrefillLoad(len(self.undispatched))

    def _dispatch(self, req, predicted: int) -> bool:
        dst = pick_decode(self.dispatcher, self.core.block_manager, req, predicted,
                          self.d.heavy_decode_threshold)
        if dst is None:
            return False
        prefilled = req.request_id in self.core.scheduler.handoff
        if not prefilled:
            self.prefilling.add(req.request_id)
        self.events.append(Handoff(req, dst, predicted, prefilled))
        return True


@dataclass
class _Receipt:
    """A request's KV on its way in: one receive per piece."""

    src: int
    blocks: tuple[int, ...]  # its blocks here
    piece_blocks: int
    pieces: dict[int, Transfer]  # piece -> its receive, until landed
    since: float  # when the last piece landed (or the receives were posted)


class DecodeRole(_Role):
    def __init__(self, core, index: int, transport, config: EngineConfig) -> None:
        super().__init__(core, index, transport, config)
        self.src: dict[str, int] = {}  # request id -> prefill instance holding its KV
        self.unprefilled: set[str] = set()  # taken early: waiting for ``Prefilled``
        self.receiving: dict[str, _Receipt] = {}
        self.waiting_since: dict[str, float] = {}  # KV landed, ``Prefilled`` not yet
        self._tags = itertools.count(1)

    def poll_interval(self, idle: float) -> float:
        return TRANSFER_POLL_S if self.receiving else idle

    def handle(self, msg) -> bool:
        sched = self.core.scheduler
        if isinstance(msg, Migrate):
            req = msg.request
            self.src[req.request_id] = msg.src
            if not msg.prefilled:
                self.unprefilled.add(req.request_id)
            sched.offer(req, msg.predicted_len)
        elif isinstance(msg, Prefilled):
            rid = msg.request.request_id
            if rid in self.unprefilled and sched.refresh(msg.request):
                self.unprefilled.discard(rid)
        else:
            return False
        self.core.notify()
        return True

    def _tag(self) -> int:
        # Unique per receiver and, for shared-memory names, across the deployment;
        # torch.distributed tags are 32-bit.
        return (next(self._tags) % 2_000_000) * 1024 + self.index

    def poll(self) -> list[RequestDelta]:
        core = self.core
        sched = core.scheduler
        kv = core.executor.kv_caches
        now = time.monotonic()
        while (req := sched.admit_next()) is not None:
            rid = req.request_id
            blocks = tuple(core.block_manager.table(rid))
            per = piece_blocks(self.d.kv_transfer_granularity, self.d.prefill_chunk_size,
                               core.block_manager.block_size, len(blocks))
            tags, pieces = [], {}
            try:
                for k in range(num_pieces(len(blocks), per)):
                    tags.append(self._tag())
                    n = len(piece_range(k, per, len(blocks)))
                    pieces[k] = self.transport.recv(staged_shape(kv, n), kv[0][0].dtype,
                                                    self.src[rid], tags[-1])
            except Exception as e:
                for t in pieces.values():
                    t.close()
                self._fail(rid, f"KV transfer from instance {self.src[rid]} failed:"
                           f" {type(e).__name__}: {e}")
                self.events.append(KVReceived(rid, self.src.pop(rid)))
                continue
            self.receiving[rid] = _Receipt(self.src[rid], blocks, per, pieces, now)
            self.events.append(ReadyToReceive(rid, self.src[rid], self.index, tuple(tags),
                                              len(blocks), per))
        for rid, rc in list(self.receiving.items()):
            for k, t in list(rc.pieces.items()):
                try:  # a piece that failed is gone; the others still land (and are dropped)
                    if not t.done():
                        continue
                    core.trip("kv_recv")
                    if rid in sched.receiving:  # else it ended meanwhile: bytes are dropped
                        scatter_blocks(kv, [rc.blocks[b] for b in
                                            piece_range(k, rc.piece_blocks, len(rc.blocks))],
                                       t.tensor)
                except Exception as e:
                    self._fail_receipt(rid, rc, f"{type(e).__name__}: {e}")
                t.close()
                del rc.pieces[k]
                rc.since = now
            if rc.pieces:
                if now - rc.since <= self.d.kv_transfer_timeout:
                    continue
                self._fail_receipt(rid, rc, f"no KV after {now - rc.since:.0f}s")
                for t in rc.pieces.values():
                    t.close()
            del self.receiving[rid]
            self.src.pop(rid, None)
            self.events.append(KVReceived(rid, rc.src))  # the sender may free its blocks
            if rid in sched.receiving:
                self.waiting_since[rid] = now
            else:  # it ended meanwhile
                self.unprefilled.discard(rid)
        for rid, since in list(self.waiting_since.items()):
            if rid not in sched.receiving:  # ended meanwhile
                del self.waiting_since[rid]
                self.unprefilled.discard(rid)
            elif rid not in self.unprefilled:
                del self.waiting_since[rid]
                sched.activate(rid)
                core.notify()
            elif now - since > self.d.kv_transfer_timeout:
                del self.waiting_since[rid]
                self.unprefilled.discard(rid)
                self._fail(rid, "its KV arrived but the end of its prefill was not reported"
                           f" within {self.d.kv_transfer_timeout:.0f}s")
        if len(self.src) > len(sched.requests) + len(sched.incoming):
            offered = {i.req.request_id for i in sched.incoming}
            for rid in [r for r in self.src if r not in sched.requests and r not in offered]:
                del self.src[rid]  # ended before it was admitted
                self.unprefilled.discard(rid)
        return super().poll()

    def _fail_receipt(self, rid: str, rc: _Receipt, why: str) -> None:
        if rid in self.core.scheduler.requests:
            self._fail(rid, f"KV transfer from instance {rc.src} failed: {why}")

    def load(self) -> DecodeLoad:
        sched = self.core.scheduler
        heavy, light = sched.heavy_light()
        return DecodeLoad(self.index, sched.free_blocks, heavy, light,
                          waiting=len(sched.incoming))


ROLES = {"prefill": PrefillRole, "decode": DecodeRole}
