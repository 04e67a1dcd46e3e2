"""A served prefill or decode instance: an engine-core process in a role.

The instance runs the engine core's loop (``fluidserve.engine.core_proc``) with its role's
scheduler (``role_scheduler_factory``) and a role object that the loop calls between
iterations: it handles the hand-off commands (``fluidserve.disagg.messages``), moves KV over
the transport, and adds its events to the outputs the instance sends to the front end.

- ``PrefillRole``: when a request's prefill ends (its first token is sampled and sent to the
  client as usual), the length predictor buckets its output length and the dispatcher picks
  a decode instance from the monitor's last broadcast (``Handoff``); on ``SendKV`` it sends
  the request's blocks; on ``ReleaseKV`` (the receiver confirmed) it frees them.
- ``DecodeRole``: takes ``Migrate``d requests into the decode scheduler's admission queue;
  each admitted request gets its blocks reserved and a receive posted (``ReadyToReceive``);
  when the bytes have landed it writes them into its cache, the request decodes from the
  next iteration on, and the instance confirms (``KVReceived``). A transfer that fails or
  takes longer than ``kv_transfer_timeout`` fails its request with an error the client sees.

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

from fluidserve.config import EngineConfig
from fluidserve.disagg.cluster import pick_decode, predict_length, role_scheduler_factory
from fluidserve.disagg.dispatch import DecodeLoad, Dispatcher
from fluidserve.disagg.messages import (
    DecodeLoads,
    Handoff,
    KVReceived,
    Migrate,
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
    init_method: str  # torch.distributed rendezvous (gloo transport)
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
                               spec.init_method, spec.session)
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


class PrefillRole(_Role):
    def __init__(self, core, index: int, transport, config: EngineConfig) -> None:
        super().__init__(core, index, transport, config)
        d = self.d
        self.predictor = make_predictor(d.length_predictor, d.predictor_granularity,
                                        d.predictor_accuracy, config.model.seed,
                                        d.length_predictor_path)
        self.dispatcher = Dispatcher(d.dispatcher, config.model.seed + index)
        self.announced: set[str] = set()
        self.undispatched: dict[str, int] = {}  # request id -> predicted length
        self.sending: list[Transfer] = []  # kept until landed: their tensors must live

    def poll_interval(self, idle: float) -> float:
        return TRANSFER_POLL_S if self.sending else idle

    def handle(self, msg) -> bool:
        sched = self.core.scheduler
        if isinstance(msg, DecodeLoads):
            self.dispatcher.broadcast(list(msg.loads))
            for rid, predicted in list(self.undispatched.items()):
                req = sched.handoff.get(rid)
                if req is None or self._dispatch(req, predicted):
                    del self.undispatched[rid]
        elif isinstance(msg, Redispatch):
            req = sched.handoff.get(msg.request_id)
            if req is not None:
                self.undispatched[req.request_id] = predict_length(
                    self.predictor, req, req.params.max_tokens)
                self.changed = True
        elif isinstance(msg, SendKV):
            self._send(msg)
        elif isinstance(msg, ReleaseKV):
            sched.release(msg.request_id)
            self.announced.discard(msg.request_id)
            self.core.notify()
            self.changed = True  # report the freed blocks
        else:
            return False
        return True

    def _send(self, msg: SendKV) -> None:
        core = self.core
        kv = core.executor.kv_caches
        req = core.scheduler.handoff.get(msg.request_id)
        try:
            core.trip("kv_send")
            if req is not None:
                blocks = core.block_manager.table(msg.request_id)[:msg.num_blocks]
                self.sending.append(self.transport.send(gather_blocks(kv, blocks), msg.dst,
                                                        msg.tag))
                return
        except Exception as e:  # the request fails here, and the front end drops it there
            self._fail(msg.request_id, f"KV transfer to instance {msg.dst} failed:"
                       f" {type(e).__name__}: {e}")
        # The request ended here (aborted, failed): the receiver still gets bytes of the
        # size it posted for, so that its receive completes (it discards them).
        import torch

        filler = torch.zeros(staged_shape(kv, msg.num_blocks), dtype=kv[0][0].dtype)
        try:
            self.sending.append(self.transport.send(filler, msg.dst, msg.tag))
        except Exception:
            log.exception("sending filler KV for %s failed", msg.request_id)

    def poll(self) -> list[RequestDelta]:
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
        handoff = self.core.scheduler.handoff
        for rid, req in handoff.items():
            if rid in self.announced:
                continue
            self.announced.add(rid)
            predicted = predict_length(self.predictor, req, req.params.max_tokens)
            if not self._dispatch(req, predicted):
                self.undispatched[rid] = predicted
        if len(self.announced) > len(handoff):  # some ended here while waiting
            self.announced &= handoff.keys()
        return super().annotate(out)

    def load(self) -> PrefillLoad:
        return PrefillLoad(len(self.undispatched))

    def _dispatch(self, req, predicted: int) -> bool:
        dst = pick_decode(self.dispatcher, self.core.block_manager, req, predicted,
                          self.d.heavy_decode_threshold)
        if dst is None:
            return False
        self.events.append(Handoff(req, dst, predicted))
        return True


class DecodeRole(_Role):
    def __init__(self, core, index: int, transport, config: EngineConfig) -> None:
        super().__init__(core, index, transport, config)
        self.src: dict[str, int] = {}  # request id -> prefill instance holding its KV
        self.receiving: dict[str, tuple[Transfer, tuple[int, ...]]] = {}
        self._tags = itertools.count(1)

    def poll_interval(self, idle: float) -> float:
        return TRANSFER_POLL_S if self.receiving else idle

    def handle(self, msg) -> bool:
        if not isinstance(msg, Migrate):
            return False
        req = msg.request
        self.src[req.request_id] = msg.src
        self.core.scheduler.offer(req, msg.predicted_len)
        self.core.notify()
        return True

    def poll(self) -> list[RequestDelta]:
        core = self.core
        sched = core.scheduler
        kv = core.executor.kv_caches
        while (req := sched.admit_next()) is not None:
            rid = req.request_id
            blocks = tuple(core.block_manager.table(rid))
            # Unique per receiver and, for shared-memory names, across the deployment;
            # torch.distributed tags are 32-bit.
            tag = (next(self._tags) % 2_000_000) * 1024 + self.index
            try:
                t = self.transport.recv(staged_shape(kv, len(blocks)), kv[0][0].dtype,
                                        self.src[rid], tag)
            except Exception as e:
                self._fail(rid, f"KV transfer from instance {self.src[rid]} failed:"
                           f" {type(e).__name__}: {e}")
                self.events.append(KVReceived(rid, self.src.pop(rid)))
                continue
            self.receiving[rid] = (t, blocks)
            self.events.append(ReadyToReceive(rid, self.src[rid], self.index, tag, len(blocks)))
        for rid, (t, blocks) in list(self.receiving.items()):
            try:
                if not t.done():
                    waited = time.monotonic() - t.started
                    if waited <= self.d.kv_transfer_timeout:
                        continue
                    raise TimeoutError(f"no KV after {waited:.0f}s")
                core.trip("kv_recv")
                if rid in sched.receiving:  # else it ended meanwhile: the bytes are dropped
                    scatter_blocks(kv, blocks, t.tensor)
                    sched.activate(rid)
                    core.notify()
            except Exception as e:
                if rid in sched.requests:
                    self._fail(rid, f"KV transfer from instance {self.src[rid]} failed:"
                               f" {type(e).__name__}: {e}")
            del self.receiving[rid]
            t.close()
            self.events.append(KVReceived(rid, self.src.pop(rid)))  # the sender may free
        if len(self.src) > len(sched.requests) + len(sched.incoming):
            offered = {i.req.request_id for i in sched.incoming}
            for rid in [r for r in self.src if r not in sched.requests and r not in offered]:
                del self.src[rid]  # ended before it was admitted
        return super().poll()

    def load(self) -> DecodeLoad:
        sched = self.core.scheduler
        heavy, light = sched.heavy_light()
        return DecodeLoad(self.index, sched.free_blocks, heavy, light,
                          waiting=len(sched.incoming))


ROLES = {"prefill": PrefillRole, "decode": DecodeRole}
