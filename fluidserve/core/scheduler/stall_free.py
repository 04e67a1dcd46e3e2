"""Hybrid batches: running decodes first, then prefill work, in the same iteration.

``sarathi`` is Sarathi-Serve's stall-free batching (OSDI'24, Algorithm 3): decodes, then
ongoing prefill chunks, then new requests, each chunk min(remaining, budget left) so the
iteration never exceeds the token budget and decodes never wait for a prompt.
The same skeleton with other settings gives the baselines it is compared with:

- ``orca``: decodes plus whole new prompts, no chunking and no token budget.
- ``hybrid_only`` (paper ablation): hybrid batches of whole prompts under the token budget.
- ``decode_maximal`` (Sarathi, 2023): at most one prefill chunk per batch, filled with decodes.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from fluidserve.core.block_manager import BlockManager
from fluidserve.core.scheduler.base import Batch, Scheduler, SchedulerLimits


class StallFreeScheduler(Scheduler):
    name = "sarathi"

    def __init__(
        self,
        limits: SchedulerLimits,
        block_manager: BlockManager,
        *,
        chunked: bool = True,
        use_budget: bool = True,
        max_prefills: float = math.inf,
    ) -> None:
        super().__init__(limits, block_manager)
        self.chunked = chunked
        self.use_budget = use_budget
        self.max_prefills = max_prefills

    #: (decode contexts, cached prefix of the next prefill) -> this iteration's token budget;
    #: set by the engine for ``--token-budget auto`` (the budget that keeps the iteration
    #: within the TBT SLO), else the fixed ``limits.token_budget`` applies.
    budget_policy: Callable[[list[int], int], int] | None = None

    def _build(self, now: float) -> Batch:
        batch = self._new_batch(self.limits.token_budget if self.use_budget else math.inf)
        self._schedule_decodes(batch)
        if self.budget_policy is not None and self.use_budget:
            ctxs = [r.num_computed_tokens + 1 for r, _, decode in batch.entries if decode]
            batch.budget = self.budget_policy(ctxs, self._next_prefix(batch))
            batch.left = batch.budget - len(ctxs)
        self._schedule_prefills(batch, now, chunked=self.chunked, max_prefills=self.max_prefills)
        return batch

    def _next_prefix(self, batch: Batch) -> int:
        """Tokens already cached for the prefill that would get this iteration's chunk."""
        for req in self.running:
            if not req.is_decode and req.request_id not in batch.ids:
                return req.num_computed_tokens
        for req in self.waiting.in_order():  # the next admitted: what the cache holds of it
            return len(self._cached_prefix(req)) * self.bm.block_size
        return 0
