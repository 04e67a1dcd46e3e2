"""TetriInfer's instance schedulers: prefill-only and decode-only engine cores.

A **prefill instance** runs chunked prefills of one fixed size (TetriInfer's ChunkSize: the
token count that saturates the device), packing requests from its local queue (FCFS, SJF or
LJF, sorted within windows of ``PrefillSchedBatch`` arrivals so that no request starves). It
runs no decodes: when a request's prefill completes and samples its first token, the request
becomes ``MIGRATING`` and keeps its KV blocks until the control plane has moved them to a
decode instance and calls ``release``.

A **decode instance** receives prefilled requests (``offer``), admits them by its admission
policy, gets their KV blocks filled by a transfer (``admit_next`` reserves them, ``activate``
marks them arrived), and runs continuous decode batches. A request may be offered before its
prefill has ended (chunk-level KV transfer): its blocks are reserved for the whole prompt,
and ``refresh`` brings the prefilled request before it is activated. A request it must preempt is
recomputed locally (its prompt and generated tokens are all here), like any preemption in
this engine.

Admission policies (TetriInfer section 3.4), with lengths from the length predictor:

- ``greedy``: admit while the free blocks hold the request's current tokens (what vLLM does);
- ``reserve_static``: admit only if the free blocks hold its predicted final length;
- ``reserve_dynamic``: admit only if the free blocks, less what the running requests are
  predicted to still need, hold its predicted final length.

``role_scheduler_factory`` builds either from the engine's configuration, for the in-process
cluster (``fluidserve.disagg.cluster``) and the served instances (``fluidserve.disagg.instance``)
alike.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from fluidserve.config import DECODE_ADMISSIONS, EngineConfig
from fluidserve.core.block_manager import BlockManager
from fluidserve.core.scheduler.base import Batch, Scheduler, SchedulerLimits
from fluidserve.core.scheduler.output import RunnerOutput, SchedulerOutput
from fluidserve.request import Request, RequestStatus


class PrefillOnlyScheduler(Scheduler):
    """Fixed-size prefill chunks from the local queue; finished prefills wait for hand-off."""

    name = "prefill_only"

    def __init__(self, limits: SchedulerLimits, block_manager: BlockManager) -> None:
        super().__init__(limits, block_manager)
        self.handoff: dict[str, Request] = {}  # prefilled, holding KV, in completion order

    def _build(self, now: float) -> Batch:
        batch = self._new_batch(self.limits.token_budget)
        self._schedule_prefills(batch, now, chunked=True)
        return batch

    def update(self, output: SchedulerOutput, result: RunnerOutput, now: float) -> list[Request]:
        touched = super().update(output, result, now)
        for req in touched:
            if not req.status.finished:  # its first token: the prefill is done
                self.running.remove(req)
                req.status = RequestStatus.MIGRATING
                self.handoff[req.request_id] = req
        return touched

    def release(self, request_id: str) -> Request | None:
        """The decode instance has the request's KV: free it here and forget the request."""
        req = self.handoff.pop(request_id, None)
        if req is not None:
            self.bm.free(request_id)
            self.requests.pop(request_id, None)
            self._released.append(request_id)
        return req

    def finish(self, req: Request, status: RequestStatus, now: float | None = None) -> None:
        self.handoff.pop(req.request_id, None)
        super().finish(req, status, now)

    def has_work(self) -> bool:
        """Something to compute (hand-offs only wait)."""
        return bool(self.running) or bool(self.num_waiting)

    @property
    def queued_prefill_tokens(self) -> int:
        """Prefill tokens not yet computed: the instance's load for routing."""
        return sum(r.num_remaining for r in self.running) + sum(
            r.num_remaining for r in self.waiting)  # no need to sort the queue to add it up


def kv_tokens(req: Request) -> int:
    """Tokens of KV a request brings to a decode instance: its prompt, also when it is handed
    off before its prefill has ended (chunk-level KV transfer)."""
    return max(req.num_computed_tokens, req.num_prompt_tokens)


@dataclass
class Incoming:
    """A prefilled request offered to a decode instance, not yet admitted."""

    req: Request
    predicted_len: int  # predicted final output length (tokens)


class DecodeOnlyScheduler(Scheduler):
    """Continuous decode batches over requests prefilled elsewhere."""

    name = "decode_only"

    def __init__(self, limits: SchedulerLimits, block_manager: BlockManager,
                 admission: str = "greedy", heavy_threshold: int = 128) -> None:
        if admission not in DECODE_ADMISSIONS:
            raise ValueError(f"unknown decode admission {admission!r}; choose from"
                             f" {', '.join(DECODE_ADMISSIONS)}")
        super().__init__(limits, block_manager)
        self.admission = admission
        self.heavy_threshold = heavy_threshold
        self.incoming: deque[Incoming] = deque()
        self.receiving: dict[str, Request] = {}  # blocks reserved, KV in transit
        self.predicted: dict[str, int] = {}  # request id -> predicted final output length

    # ------------------------------------------------------------------ hand-off
    def offer(self, req: Request, predicted_len: int) -> None:
        """Queue a prefilled request (prompt computed, first token sampled) for admission."""
        self.incoming.append(Incoming(req, predicted_len))

    def admissible(self, req: Request, predicted_len: int) -> bool:
        """Whether the admission policy lets ``req`` take its KV blocks now.

        Requests preempted here go first (they wait in the local queue to be recomputed), so
        nothing new is admitted while one waits. An instance holding no request admits
        whatever fits now, so a prediction larger than the whole cache cannot block it."""
        if self.num_waiting:
            return False
        if len(self.requests) >= self.limits.max_num_seqs:
            return False
        bm = self.bm
        now_blocks = bm.blocks_for(kv_tokens(req))
        fits_now = now_blocks <= bm.num_free_blocks - bm.watermark_blocks
        if self.admission == "greedy" or not self.requests:
            return fits_now
        final = bm.blocks_for(req.num_prompt_tokens + max(predicted_len, 1))
        need = max(final, now_blocks)
        if self.admission == "reserve_static":
            return fits_now and need <= bm.num_free_blocks
        return fits_now and need + self.predicted_growth() <= bm.num_free_blocks

    def predicted_growth(self) -> int:
        """Blocks the requests admitted here (running, receiving their KV, or preempted) are
        predicted to still take."""
        total = 0
        for req in self.requests.values():
            final = req.num_prompt_tokens + max(self.predicted.get(req.request_id, 0),
                                                len(req.output_token_ids) + 1)
            total += max(0, self.bm.blocks_for(final) - len(self.bm.table(req.request_id)))
        return total

    def admit_next(self) -> Request | None:
        """Reserve blocks for the first incoming request if its admission allows (FIFO: a
        large request at the head is not overtaken, so it cannot starve); the caller moves
        its KV into ``bm.table(id)`` and then calls ``activate``."""
        while self.incoming and self.incoming[0].req.status.finished:
            self.incoming.popleft()  # ended while it waited (aborted)
        if not self.incoming:
            return None
        head = self.incoming[0]
        req = head.req
        if not self.admissible(req, head.predicted_len):
            return None
        if not self.bm.allocate(req.request_id, kv_tokens(req)):
            return None
        self.incoming.popleft()
        self.requests[req.request_id] = req
        self.receiving[req.request_id] = req
        self.predicted[req.request_id] = head.predicted_len
        return req

    def activate(self, request_id: str) -> bool:
        """The request's KV has arrived: it decodes from the next iteration on. False if it
        ended meanwhile (its blocks are freed)."""
        req = self.receiving.pop(request_id, None)
        if req is None:
            return False
        if req.status.finished:
            self.finish(req, req.status)
            return False
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        return True

    def refresh(self, req: Request) -> bool:
        """The request, handed off before its prefill ended, as it is now that the prefill
        has (its first token sampled): it replaces the copy offered or receiving here. False
        if that copy is gone (it ended)."""
        rid = req.request_id
        if (item := self._offer(rid)) is not None:
            item.req = req
            return True
        if rid in self.receiving:
            self.receiving[rid] = self.requests[rid] = req
            return True
        return False

    def _offer(self, request_id: str):
        """The queued offer of this request, if any."""
        return next((i for i in self.incoming if i.req.request_id == request_id), None)

    def find(self, request_id: str) -> Request | None:
        """Admitted, or still an offer waiting for admission."""
        req = self.requests.get(request_id)
        if req is None and (item := self._offer(request_id)) is not None:
            req = item.req
        return req

    def held(self) -> list[str]:
        return [*self.requests, *(i.req.request_id for i in self.incoming)]

    def withdraw(self, request_id: str) -> Request | None:
        """Drop an offered (not yet admitted) request, e.g. when its client went away."""
        item = self._offer(request_id)
        if item is None:
            return None
        self.incoming.remove(item)
        return item.req

    def finish(self, req: Request, status: RequestStatus, now: float | None = None) -> None:
        """Also for a request that already ended elsewhere (aborted at the prefill instance
        while its KV was on the way): whatever it holds here is released."""
        rid = req.request_id
        self.receiving.pop(rid, None)
        self.predicted.pop(rid, None)
        self.withdraw(rid)
        super().finish(req, status, now)

    # ------------------------------------------------------------------ the iteration
    def _build(self, now: float) -> Batch:
        batch = self._new_batch(self.limits.token_budget)
        self._schedule_decodes(batch)
        # Requests preempted here recompute their prompt and outputs locally.
        self._schedule_prefills(batch, now, chunked=True)
        return batch

    def has_work(self) -> bool:
        return bool(self.running) or bool(self.num_waiting)

    # ------------------------------------------------------------------ load
    def is_heavy(self, request_id: str) -> bool:
        return self.predicted.get(request_id, 0) > self.heavy_threshold

    def heavy_light(self) -> tuple[int, int]:
        heavy = sum(1 for rid in self.requests if self.is_heavy(rid))
        heavy += sum(1 for i in self.incoming if i.predicted_len > self.heavy_threshold)
        total = len(self.requests) + len(self.incoming)
        return heavy, total - heavy

    @property
    def free_blocks(self) -> int:
        """What the dispatcher sees as free here: the free blocks less what the queued offers
        take now and, under ``reserve_dynamic``, what the admitted requests are predicted to
        still take (so a request sent here because it "fits" is one admission can take)."""
        queued = sum(self.bm.blocks_for(kv_tokens(i.req)) for i in self.incoming)
        growth = self.predicted_growth() if self.admission == "reserve_dynamic" else 0
        return self.bm.num_free_blocks - queued - growth


ROLES = ("prefill", "decode")


def role_scheduler_factory(config: EngineConfig, role: str
                           ) -> Callable[[SchedulerLimits, BlockManager], Scheduler]:
    """The scheduler of an engine core in ``role``, from the engine's limits: fixed-size
    prefill chunks from the local queue, or continuous decode batches under the admission
    policy (its budget: the engine's, at least ``max_num_seqs``)."""
    if role not in ROLES:
        raise ValueError(f"unknown instance role {role!r}; choose from {', '.join(ROLES)}")
    d, sc = config.disagg, config.scheduler

    def make(limits: SchedulerLimits, bm: BlockManager) -> Scheduler:
        if role == "prefill":
            lim = dataclasses.replace(limits, token_budget=d.prefill_chunk_size,
                                      queue_policy=d.prefill_policy,
                                      queue_window=d.prefill_sched_batch)
            return PrefillOnlyScheduler(lim, bm)
        budget = sc.token_budget if isinstance(sc.token_budget, int) else 512
        lim = dataclasses.replace(limits, token_budget=max(budget, limits.max_num_seqs))
        return DecodeOnlyScheduler(lim, bm, d.decode_admission, d.heavy_decode_threshold)
    return make
