"""Which decode instance gets a prefilled request (TetriInfer section 3.4.1).

The prefill instance's dispatcher sees the decode instances' loads as the cluster monitor
last broadcast them (every ``monitor_interval``), so it updates its own copy as it sends
work: dispatches between two broadcasts do not all land on the instance that looked
emptiest at the last one.

- ``power_of_two`` (TetriInfer): among the decode instances with enough free KV for the
  request's predicted final length, sample two and take the one with the lower heavy:light
  ratio of decodes (heavy = predicted to generate more than the heavy threshold), then more
  free KV;
- ``random``, ``round_robin``, ``least_loaded`` (fewest requests, then most free KV): the
  alternatives TetriInfer compares against.

With no instance able to hold the predicted length, the one with the most free KV is taken
if it can at least hold the request's current tokens; otherwise the request waits at the
prefill instance, holding its KV, and is dispatched again later.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

from fluidserve.config import DISPATCHERS
from fluidserve.core.block_manager import BlockManager
from fluidserve.core.scheduler.disagg import kv_tokens
from fluidserve.request import Request


@dataclass(frozen=True)
class DecodeLoad:
    """What the monitor broadcasts about one decode instance."""

    instance: int
    free_blocks: int
    heavy: int
    light: int
    accepting: bool = True  # False while draining for a flip
    waiting: int = 0  # requests offered to it and not yet admitted (for the flip policy)

    @property
    def requests(self) -> int:
        return self.heavy + self.light

    @property
    def heavy_ratio(self) -> float:
        return self.heavy / (self.light + 1)


class Dispatcher:
    def __init__(self, policy: str = "power_of_two", seed: int = 0) -> None:
        if policy not in DISPATCHERS:
            raise ValueError(f"unknown dispatcher {policy!r}; choose from {', '.join(DISPATCHERS)}")
        self.policy = policy
        self.rng = random.Random(seed)
        self._next = 0
        self.view: dict[int, DecodeLoad] = {}

    def broadcast(self, loads: list[DecodeLoad]) -> None:
        """A fresh snapshot from the cluster monitor."""
        self.view = {load.instance: load for load in loads}

    def pick(self, need_blocks: int, now_blocks: int, heavy: bool) -> int | None:
        """A decode instance for a request predicted to need ``need_blocks`` in the end and
        holding ``now_blocks`` now; None if none can take it yet."""
        open_ = [ld for ld in self.view.values() if ld.accepting]
        fits = [ld for ld in open_ if ld.free_blocks >= need_blocks]
        if not fits:
            roomy = max(open_, key=lambda ld: ld.free_blocks, default=None)
            if roomy is None or roomy.free_blocks < now_blocks:
                return None
            choice = roomy
        elif self.policy == "power_of_two":
            pair = self.rng.sample(fits, min(2, len(fits)))
            choice = min(pair, key=lambda ld: (ld.heavy_ratio, -ld.free_blocks, ld.instance))
        elif self.policy == "random":
            choice = self.rng.choice(fits)
        elif self.policy == "round_robin":
            order = sorted(fits, key=lambda ld: ld.instance)
            choice = next((ld for ld in order if ld.instance >= self._next), order[0])
            self._next = choice.instance + 1
        else:  # least_loaded
            choice = min(fits, key=lambda ld: (ld.requests, -ld.free_blocks, ld.instance))
        # Until the next broadcast, what that one will say: the offer holds its blocks now
        # (the broadcast counts queued offers at their current size, not their final one).
        self.view[choice.instance] = replace(
            choice, free_blocks=choice.free_blocks - now_blocks,
            heavy=choice.heavy + heavy, light=choice.light + (not heavy))
        return choice.instance


def pick_decode(dispatcher: Dispatcher, bm: BlockManager, req: Request, predicted: int,
                heavy_threshold: int) -> int | None:
    """The decode instance a prefilled request goes to (None: none can take it yet)."""
    need = bm.blocks_for(req.num_prompt_tokens + max(predicted, 1))
    return dispatcher.pick(need, bm.blocks_for(kv_tokens(req)), predicted > heavy_threshold)
