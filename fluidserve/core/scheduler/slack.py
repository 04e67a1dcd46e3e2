"""Slack-aware stall-free batching (``sarathi_slack``): decodes ahead of their deadlines lend
their turn to the prefill.

Etalon's deadlines (D_d = the TBT SLO) give every running decode a deadline for its next
token: one D_d after its previous deadline if that one was met (slack carries forward), one
D_d after its previous token if not. Plain stall-free batching schedules every decode in
every iteration. Here a decode whose next deadline is at least two target iteration times
away sits this iteration out: it still gets its token by the end of the next iteration,
before its deadline, since ``--token-budget auto`` keeps every iteration within the target.
The tokens and attention time it frees go to the prefill chunk. The kept decodes are
protected too: the iteration is planned to end no later than the plain stall-free iteration
would have, or before every kept decode's deadline that the plain iteration would have met.
So no request misses a deadline it would have met under plain stall-free batching (given
the iteration-time prediction); when the SLO cannot be met even by decode-only iterations,
nothing is skipped.
"""

from __future__ import annotations

import math

from fluidserve.core.scheduler.base import Batch
from fluidserve.core.scheduler.output import RunnerOutput, SchedulerOutput
from fluidserve.core.scheduler.stall_free import StallFreeScheduler
from fluidserve.request import Request, RequestStatus


class SlackScheduler(StallFreeScheduler):
    name = "sarathi_slack"

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.deadline: dict[str, float] = {}  # request id -> deadline of its next token
        self.num_skipped = 0  # decode turns lent to prefills
        self.lent: set[str] = set()  # requests that lent a turn since their last token

    def update(self, output: SchedulerOutput, result: RunnerOutput, now: float
               ) -> list[Request]:
        touched = super().update(output, result, now)
        if self.budget_policy is None:
            return touched
        d_d = self.budget_policy.tbt_slo
        for req in touched:
            rid = req.request_id
            self.lent.discard(rid)
            if req.status.finished:
                continue
            last = self.deadline.get(rid)
            # Met: slack carries forward; missed (or the first token): re-base on the token.
            self.deadline[rid] = last + d_d if last is not None and now <= last else now + d_d
        return touched

    def finish(self, req: Request, status: RequestStatus, now: float | None = None) -> None:
        super().finish(req, status, now)  # (an aborted request is never touched again)
        self.deadline.pop(req.request_id, None)
        self.lent.discard(req.request_id)

    def _build(self, now: float) -> Batch:
        pol = self.budget_policy
        if pol is None:  # no iteration-time prediction (a bare scheduler): plain stall-free
            return super()._build(now)
        batch = self._new_batch(math.inf)
        self._schedule_decodes(batch)
        decodes = [r for r, _, decode in batch.entries if decode]
        ctxs = [r.num_computed_tokens + 1 for r in decodes]
        prefix = self._next_prefix(batch)
        budget = plain_budget = pol(ctxs, prefix)
        plain_time = pol.predict(ctxs, budget - len(ctxs), prefix)
        keep, skipped = decodes, []
        if pol.reachable and self._has_prefill(batch):
            far = now + 2 * pol.target
            keep = [r for r in decodes if self.deadline.get(r.request_id, now) < far]
        if len(keep) < len(decodes):
            # End no later than the plain iteration, or before every kept deadline that the
            # plain iteration would have met.
            met = [self.deadline[r.request_id] - now for r in keep
                   if r.request_id in self.deadline
                   and self.deadline[r.request_id] - now >= plain_time]
            limit = min(pol.target, max(plain_time, min(met, default=math.inf)))
            kept_ctxs = [r.num_computed_tokens + 1 for r in keep]
            chunk, _ = pol.chunk(kept_ctxs, prefix, limit)
            if chunk > budget - len(ctxs):
                skipped = [r for r in decodes if r not in keep]
                batch = self._new_batch(math.inf)
                for r in keep:  # the skipped keep their blocks for their next turn
                    batch.add(r, 1, is_decode=True)
                # ...and are no victims for the prefills' blocks: lending a turn must not
                # cost a recompute that plain stall-free batching (where they are members)
                # would not have made.
                batch.ids.update(r.request_id for r in skipped)
                budget = len(keep) + chunk
        batch.budget = budget
        batch.left = budget - len(batch.entries)
        pol.last = budget
        self._schedule_prefills(batch, now, chunked=True, max_prefills=self.max_prefills)
        if skipped and batch.num_prefills == 0:
            # No prefill could start after all (no KV room, or max_num_seqs): lending the
            # turn would only delay the decodes, and an empty batch would stall the engine.
            for r in skipped:
                batch.add(r, 1, is_decode=True)
            # The plain stall-free iteration after all, and reported as one.
            batch.budget = pol.last = plain_budget
            batch.left = plain_budget - len(batch.entries)
        else:
            self.num_skipped += len(skipped)
            self.lent.update(r.request_id for r in skipped)
        return batch

    def _has_prefill(self, batch: Batch) -> bool:
        return bool(self.waiting) or any(not r.is_decode and r.request_id not in batch.ids
                                         for r in self.running)
