"""The decode side of the hand-off (TetriInfer): requests taken in, their KV received.

``Migrate``d requests join the decode scheduler's admission queue (working-set aware,
``fluidserve.core.scheduler.disagg``); each admitted request gets its blocks reserved and
one receive posted per piece (``ReadyToReceive``); each piece that lands is written into its
cache; once all have and the prefill has ended (``Prefilled`` for an early hand-off) the
request decodes from the next iteration on, and the instance confirms (``KVReceived``, after
which the sender frees its blocks). A transfer that fails or makes no progress for
``kv_transfer_timeout`` fails its request with an error the client sees.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from fluidserve.config import EngineConfig
from fluidserve.disagg.dispatch import DecodeLoad
from fluidserve.disagg.messages import (
    KVReceived,
    Migrate,
    Prefilled,
    ReadyToReceive,
    clock_offset,
)
from fluidserve.disagg.role import Role
from fluidserve.disagg.transfer import (
    Transfer,
    num_pieces,
    piece_blocks,
    piece_range,
    scatter_blocks,
    staged_shape,
)
from fluidserve.engine.messages import RequestDelta


@dataclass
class _Receipt:
    """A request's KV on its way in: one receive per piece."""

    src: int
    blocks: tuple[int, ...]  # its blocks here
    piece_blocks: int
    pieces: dict[int, Transfer]  # piece -> its receive, until landed
    since: float  # when the last piece landed (or the receives were posted)


class DecodeRole(Role):
    def __init__(self, core, index: int, transport, config: EngineConfig,
                 tags=None) -> None:
        super().__init__(core, index, transport, config, tags)
        self.src: dict[str, int] = {}  # request id -> prefill instance holding its KV
        self.unprefilled: set[str] = set()  # taken early: waiting for ``Prefilled``
        self.receiving: dict[str, _Receipt] = {}
        self.waiting_since: dict[str, float] = {}  # KV landed, ``Prefilled`` not yet

    def in_flight(self) -> int:
        return len(self.receiving)

    def handle(self, msg) -> bool:
        sched = self.core.scheduler
        if isinstance(msg, Migrate):
            req = msg.request
            req.shift_times(clock_offset(msg.stamp))
            self.src[req.request_id] = msg.src
            if not msg.prefilled:
                self.unprefilled.add(req.request_id)
            sched.offer(req, msg.predicted_len)
        elif isinstance(msg, Prefilled):
            rid = msg.request.request_id
            msg.request.shift_times(clock_offset(msg.stamp))
            if rid in self.unprefilled and sched.refresh(msg.request):
                self.unprefilled.discard(rid)
        else:
            return False
        self.core.notify()
        return True

    def _tag(self) -> int:
        # Unique per receiver and, for shared-memory names, across the deployment;
        # torch.distributed tags are 32-bit.
        return (next(self.tags) % 2_000_000) * 1024 + self.index

    def poll(self) -> list[RequestDelta]:
        now = time.monotonic()
        self._post_receives(now)
        self._land(now)
        self._activate(now)
        sched = self.core.scheduler
        if len(self.src) > len(sched.requests) + len(sched.incoming):
            offered = {i.req.request_id for i in sched.incoming}
            for rid in [r for r in self.src if r not in sched.requests and r not in offered]:
                del self.src[rid]  # ended before it was admitted
                self.unprefilled.discard(rid)
        return super().poll()

    def _post_receives(self, now: float) -> None:
        """Admit what the scheduler lets in; post one receive per piece of each."""
        core = self.core
        kv = core.executor.kv_caches
        while (req := core.scheduler.admit_next()) is not None:
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

    def _land(self, now: float) -> None:
        """Write the pieces that landed into the cache; confirm each request all of whose
        pieces have (or fail it: a piece that failed, or none for ``kv_transfer_timeout``)."""
        core = self.core
        sched, kv = core.scheduler, core.executor.kv_caches
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

    def _activate(self, now: float) -> None:
        """Start decoding each request whose KV is here and whose prefill has ended."""
        sched = self.core.scheduler
        for rid, since in list(self.waiting_since.items()):
            if rid not in sched.receiving:  # ended meanwhile
                del self.waiting_since[rid]
                self.unprefilled.discard(rid)
            elif rid not in self.unprefilled:
                del self.waiting_since[rid]
                sched.activate(rid)
                self.core.notify()
            elif now - since > self.d.kv_transfer_timeout:
                del self.waiting_since[rid]
                self.unprefilled.discard(rid)
                self._fail(rid, "its KV arrived but the end of its prefill was not reported"
                           f" within {self.d.kv_transfer_timeout:.0f}s")

    def _fail_receipt(self, rid: str, rc: _Receipt, why: str) -> None:
        if rid in self.core.scheduler.requests:
            self._fail(rid, f"KV transfer from instance {rc.src} failed: {why}")

    def load(self) -> DecodeLoad:
        sched = self.core.scheduler
        heavy, light = sched.heavy_light()
        return DecodeLoad(self.index, sched.free_blocks, heavy, light,
                          waiting=len(sched.incoming))
