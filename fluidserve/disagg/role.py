"""What a disaggregated instance's role has in common: the events it adds to the outputs the
instance sends to the front end, the load it reports, the requests it fails.

The engine core's loop calls the instance between iterations (``fluidserve.disagg.instance``),
which passes each call to its role: ``handle`` (a hand-off command from the front end, True if
the role took it), ``poll`` (transfers that progressed, and the requests the role failed) and
``annotate`` (its events and load, added to the iteration's outputs).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator

from fluidserve.config import EngineConfig
from fluidserve.engine.messages import EngineCoreOutputs, RequestDelta

log = logging.getLogger(__name__)

# How often the loop polls while KV is on its way (it otherwise waits for work).
TRANSFER_POLL_S = 0.001


class Role:
    """An instance's part in the hand-off, between the core's iterations. ``events``: what
    it tells the front end next; ``deltas``: the requests it failed, returned by ``poll``."""

    def __init__(self, core, index: int, transport, config: EngineConfig,
                 tags: Iterator[int] | None = None) -> None:
        self.core, self.index, self.transport = core, index, transport
        # the instance's transfer tags: one counter for all its roles, so that a tag (a
        # shared-memory segment's name) is never used twice across flips
        self.tags = tags if tags is not None else itertools.count(1)
        self.d = config.disagg
        self.events: list = []
        self.deltas: list[RequestDelta] = []  # requests this role failed
        self.changed = False
        self._load = None  # the load last reported

    def poll_interval(self, idle: float) -> float:
        """How long the loop may wait for work (``idle`` when nothing is in transfer)."""
        return TRANSFER_POLL_S if self.in_flight() else idle

    def in_flight(self) -> int:
        """KV transfers under way here."""
        return 0

    def poll(self) -> list[RequestDelta]:
        """Progress the transfers; return the requests failed since the last call."""
        deltas, self.deltas = self.deltas, []
        return deltas

    def handle(self, msg) -> bool:
        """Act on a hand-off command; False if this role does not take ``msg``."""
        raise NotImplementedError

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
