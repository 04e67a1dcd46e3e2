"""Batching policies, picked by name from ``SCHEDULER_REGISTRY``."""

from __future__ import annotations

from collections.abc import Callable

from fluidserve.core.block_manager import BlockManager
from fluidserve.core.scheduler.base import RequestRejected, Scheduler, SchedulerLimits
from fluidserve.core.scheduler.output import RunnerOutput, ScheduledChunk, SchedulerOutput
from fluidserve.core.scheduler.prefill_first import PrefillFirstScheduler
from fluidserve.core.scheduler.request_level import RequestLevelScheduler
from fluidserve.core.scheduler.slack import SlackScheduler
from fluidserve.core.scheduler.stall_free import StallFreeScheduler

Factory = Callable[[SchedulerLimits, BlockManager], Scheduler]

SCHEDULER_REGISTRY: dict[str, Factory] = {
    "sarathi": lambda lim, bm: StallFreeScheduler(lim, bm),
    "sarathi_slack": lambda lim, bm: SlackScheduler(lim, bm),
    "orca": lambda lim, bm: StallFreeScheduler(lim, bm, chunked=False, use_budget=False),
    "hybrid_only": lambda lim, bm: StallFreeScheduler(lim, bm, chunked=False),
    "decode_maximal": lambda lim, bm: StallFreeScheduler(lim, bm, max_prefills=1),
    "vllm": lambda lim, bm: PrefillFirstScheduler(lim, bm),
    "chunked_only": lambda lim, bm: PrefillFirstScheduler(lim, bm, chunked=True),
    "faster_transformer": lambda lim, bm: RequestLevelScheduler(lim, bm),
}


def make_scheduler(name: str, limits: SchedulerLimits, block_manager: BlockManager) -> Scheduler:
    try:
        factory = SCHEDULER_REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown scheduler {name!r}; choose from {', '.join(SCHEDULER_REGISTRY)}"
        ) from None
    sched = factory(limits, block_manager)
    sched.name = name
    return sched


__all__ = [
    "SCHEDULER_REGISTRY",
    "RequestRejected",
    "RunnerOutput",
    "ScheduledChunk",
    "Scheduler",
    "SchedulerLimits",
    "SchedulerOutput",
    "make_scheduler",
]
