"""The prefill side of the hand-off (TetriInfer): where a request goes to decode, and its KV
sent there.

When a request's prefill ends (its first token is sampled and sent to the client as usual), or
with chunk-level KV transfer as soon as its first chunk has run, the length predictor buckets
its output length and the dispatcher picks a decode instance from the monitor's last broadcast
(``Handoff``; an early one is followed by ``PrefillDone``). On ``SendKV`` the role sends the
request's KV piece by piece, each once its tokens are computed; on ``ReleaseKV`` (the receiver
confirmed) it frees the blocks. Served, the predictor's "true length" is the request's
``max_tokens``: the length it will generate is unknown until it is generated (the two agree
for ``ignore_eos`` requests and a model that does not stop early).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from fluidserve.config import EngineConfig
from fluidserve.disagg.dispatch import Dispatcher, pick_decode
from fluidserve.disagg.messages import (
    DecodeLoads,
    Handoff,
    PrefillDone,
    PrefillLoad,
    Redispatch,
    ReleaseKV,
    SendKV,
    clock_stamp,
)
from fluidserve.disagg.predictor import make_predictor, predict_length
from fluidserve.disagg.role import Role
from fluidserve.disagg.transfer import (
    Transfer,
    gather_blocks,
    num_pieces,
    piece_range,
    staged_shape,
)
from fluidserve.engine.messages import EngineCoreOutputs, RequestDelta

log = logging.getLogger(__name__)


@dataclass
class _Stream:
    """A request's KV on its way out: the pieces not yet sent."""

    dst: int
    tags: tuple[int, ...]
    num_blocks: int
    piece_blocks: int
    next: int = 0  # the next piece to send


class PrefillRole(Role):
    def __init__(self, core, index: int, transport, config: EngineConfig,
                 tags=None) -> None:
        super().__init__(core, index, transport, config, tags)
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

    def in_flight(self) -> int:
        return len(self.streams) + len(self.sending)

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
                self.streams.pop(req.request_id, None)  # its receiver died: send no more
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
                self.events.append(PrefillDone(req, clock_stamp()))
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
        return PrefillLoad(len(self.undispatched), self.core.scheduler.queued_prefill_tokens)

    def _dispatch(self, req, predicted: int) -> bool:
        dst = pick_decode(self.dispatcher, self.core.block_manager, req, predicted,
                          self.d.heavy_decode_threshold)
        if dst is None:
            return False
        prefilled = req.request_id in self.core.scheduler.handoff
        if not prefilled:
            self.prefilling.add(req.request_id)
        self.events.append(Handoff(req, dst, predicted, prefilled, clock_stamp()))
        return True
