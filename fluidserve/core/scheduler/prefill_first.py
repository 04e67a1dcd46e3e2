"""Prefill-prioritizing iteration-level batching (vLLM; Sarathi-Serve Algorithm 2).

Whenever a prompt can be admitted, the iteration is prefill-only and every running decode
waits for it: the generation stall that stall-free batching removes. ``chunked_only`` is the
paper's ablation that chunks those prefills under the token budget but still never mixes
them with decodes.
"""

from __future__ import annotations

from fluidserve.core.block_manager import BlockManager
from fluidserve.core.scheduler.base import Batch, Scheduler, SchedulerLimits


class PrefillFirstScheduler(Scheduler):
    name = "vllm"

    def __init__(
        self, limits: SchedulerLimits, block_manager: BlockManager, *, chunked: bool = False
    ) -> None:
        super().__init__(limits, block_manager)
        self.chunked = chunked

    def _build(self, now: float) -> Batch:
        batch = self._new_batch(self.limits.token_budget)
        self._schedule_prefills(batch, now, chunked=self.chunked)
        if batch.entries:
            return batch
        self._schedule_decodes(batch)
        return batch
