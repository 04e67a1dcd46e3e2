"""Request-level batching (FasterTransformer; Sarathi-Serve Algorithm 1).

A batch of up to ``max_num_seqs`` requests is admitted together, prefilled together, and
decoded until every member finishes; nothing new joins until then. Requests preempted for
memory rejoin with the next batch.
"""

from __future__ import annotations

import math

from fluidserve.core.scheduler.base import Batch, Scheduler


class RequestLevelScheduler(Scheduler):
    name = "faster_transformer"
    waits_for_coming_prefix = False  # (it would wait for the whole batch)

    def _build(self, now: float) -> Batch:
        batch = self._new_batch(math.inf)
        if not self.running:
            for req in self.waiting.in_order():
                if not self._admit(req, req.num_remaining, batch, now):
                    break
            return batch
        self._schedule_decodes(batch)
        return batch
