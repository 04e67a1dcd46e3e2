"""A served prefill or decode instance: an engine-core process in a role.

The instance runs the engine core's loop (``fluidserve.engine.core_proc``) with its role's
scheduler (``role_scheduler_factory``) and a role object that the loop calls between
iterations: it handles the hand-off commands (``fluidserve.disagg.messages``), moves KV over
the transport, and adds its events to the outputs the instance sends to the front end
(``prefill_role.PrefillRole``, ``decode_role.DecodeRole``).

An instance flip (``SetRole``) replaces the scheduler and the role object of a drained
instance; the model, its KV cache and the transport stay.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from fluidserve.config import EngineConfig
from fluidserve.core.scheduler.disagg import role_scheduler_factory
from fluidserve.disagg.decode_role import DecodeRole
from fluidserve.disagg.messages import SetRole
from fluidserve.disagg.prefill_role import PrefillRole
from fluidserve.disagg.transfer import make_transport
from fluidserve.engine.messages import EngineCoreOutputs, RequestDelta

log = logging.getLogger(__name__)

ROLES = {"prefill": PrefillRole, "decode": DecodeRole}


@dataclass(frozen=True)
class InstanceSpec:
    index: int  # rank in the deployment's KV-transport group
    role: str  # prefill | decode
    world_size: int
    store: str  # host:port of the front end's rendezvous store (gloo transport)
    session: str  # names the deployment's shared-memory segments (shm transport)


def start_instance(config: EngineConfig, spec: InstanceSpec, max_records: int | None):
    """Load the model, build the core in its role, join the KV transport."""
    from fluidserve.engine.core_proc import _start_core

    limits = []
    make = role_scheduler_factory(config, spec.role)

    def factory(lim, bm):
        limits.append(lim)  # kept for a flip: the next role's scheduler starts from them
        return make(lim, bm)

    core = _start_core(config.replace(seed=config.model.seed + spec.index), max_records,
                       factory)
    transport = make_transport(config.disagg.kv_transport, spec.index, spec.world_size,
                               spec.store, spec.session)
    return core, Instance(core, spec, transport, config, limits[0])


class Instance:
    """What the core's loop calls between iterations: the current role, which an instance
    flip (``SetRole``, sent once the control plane has drained the instance) replaces."""

    def __init__(self, core, spec: InstanceSpec, transport, config: EngineConfig,
                 base_limits) -> None:
        self.core, self.index, self.transport, self.config = core, spec.index, transport, config
        self.base_limits = base_limits  # the engine's, before the role's
        self.role = ROLES[spec.role](core, spec.index, transport, config)

    def handle(self, msg) -> bool:
        if isinstance(msg, SetRole):
            self._flip(msg.role)
            return True
        return self.role.handle(msg)

    def poll_interval(self, idle: float) -> float:
        return self.role.poll_interval(idle)

    def poll(self) -> list[RequestDelta]:
        return self.role.poll()

    def annotate(self, out: EngineCoreOutputs) -> bool:
        return self.role.annotate(out)

    def close(self) -> None:
        self.transport.close()

    def _flip(self, to: str) -> None:
        core, old = self.core, self.role
        left = list(core.scheduler.requests) + [
            i.req.request_id for i in getattr(core.scheduler, "incoming", ())]
        if left:  # the control plane flips only drained instances: never silently lose one
            log.error("flipping to %s with %d requests left: failing them", to, len(left))
            old.deltas += core.fail(left, f"instance {self.index} changed role")
        core.scheduler = role_scheduler_factory(self.config, to)(self.base_limits,
                                                                 core.block_manager)
        core.notify()
        busy = old.in_flight()
        if busy:  # the control plane waits for their confirmation: never expected here
            log.error("flipping to %s with %d KV transfers under way", to, busy)
        self.role = ROLES[to](core, self.index, self.transport, self.config, old.tags)
        self.role.events, self.role.deltas, self.role.changed = old.events, old.deltas, True
        log.info("instance %d is now a %s instance", self.index, to)
