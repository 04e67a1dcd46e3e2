"""A served disaggregated deployment (``fluidserve serve --disaggregate``): its processes.

The HTTP front end talks to one engine-core process per instance (``EngineCoreClient``, each
started in its role by ``fluidserve.disagg.instance``) through this client, which has the same
interface as a single core's, so the front end does not know the difference. What it does
with the instances' outputs (routing, relaying the hand-off, loads, flips, deaths) is the
control plane's (``fluidserve.disagg.control``); here are the processes and the cluster
monitor thread, which broadcasts the decode instances' loads to the prefill instances every
``monitor_interval`` and, with ``--instance-flip``, runs the flip policy.

Each instance's outputs reach the front end as they come (the first token from the prefill
instance, the rest from the decode instance). A deployment left without a prefill or a decode
instance is dead: the server turns unhealthy and exits non-zero. KV moves between instances
over the transport chosen with ``--kv-transport`` (torch.distributed gloo, meeting at a store
hosted here, or shared memory), directly from one instance to the other.

The instances are local processes (``--distributed-executor-backend mp``) or Ray actors
placed over a Ray cluster (``ray``: ``fluidserve.disagg.placement``); the front end talks to
both the same way.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable

from fluidserve.config import ConfigError, EngineConfig
from fluidserve.disagg.control import ControlPlane
from fluidserve.disagg.dispatch import DecodeLoad
from fluidserve.disagg.instance import InstanceSpec
from fluidserve.engine.core_proc import EngineCoreClient, kill_unless_exited
from fluidserve.engine.messages import (
    CoreReady,
    EngineCoreOutputs,
)
from fluidserve.engine.telemetry import MAX_RECORDS
from fluidserve.net import local_store

log = logging.getLogger(__name__)

ROLE_FAULTS = {"kv_send": "prefill", "kv_recv": "decode"}


def check_served(config: EngineConfig) -> None:
    """What a served deployment supports (the simulator covers the rest)."""
    par = config.parallel
    if par.world_size > 1:
        raise ConfigError("--disaggregate runs each instance in one process: tensor and"
                          " pipeline parallelism within an instance are not supported")
    if config.model.device != "cpu":
        raise ConfigError("a served --disaggregate deployment runs on the CPU (its KV moves"
                          " between host caches); GPU deployments: fluidserve simulate"
                          " --disaggregate")


class DisaggClient(ControlPlane):
    """P prefill and D decode engine-core processes behind one core client's interface."""

    def __init__(self, config: EngineConfig, on_outputs: Callable[[EngineCoreOutputs], None],
                 on_dead: Callable[[str], None], telemetry_file: str | None = None,
                 max_records: int | None = MAX_RECORDS) -> None:
        check_served(config)
        d = config.disagg
        roles = ["prefill"] * d.num_prefill_instances + ["decode"] * d.num_decode_instances
        if config.model.num_threads is None:  # the instances share this machine's cores
            config = config.replace(num_threads=max(1, (os.cpu_count() or 1) // len(roles)))
        super().__init__(config, roles, on_outputs, on_dead)
        self.info: CoreReady | None = None
        self.placement = None
        host = "127.0.0.1"
        if config.parallel.distributed_executor_backend == "ray":
            from fluidserve.disagg.placement import RayPlacement

            self.placement = RayPlacement(len(roles), config.model.num_threads,
                                          same_host=d.kv_transport == "shm")
            host = self.placement.host
        # The instances' KV-transport group meets at a store hosted here (wherever Ray put
        # them, they can reach the front end).
        self._store = None
        if d.kv_transport == "gloo" and host == "127.0.0.1":
            self._store = local_store()  # listening on the loopback interface only
        elif d.kv_transport == "gloo":
            from torch.distributed import TCPStore

            self._store = TCPStore(host, 0, None, True, wait_for_workers=False)
        store = f"{host}:{self._store.port if self._store else 0}"
        session = f"{os.getpid()}-{secrets.token_hex(4)}"
        self.instances: list[EngineCoreClient] = []
        for i, role in enumerate(roles):
            spec = InstanceSpec(i, role, len(roles), store, session)
            tel = f"{telemetry_file}.{role}{i}" if telemetry_file else None
            self.instances.append(EngineCoreClient(
                config, lambda msg, i=i: self._on_instance_outputs(i, msg),
                lambda message, i=i: self._on_instance_dead(i, message), tel, max_records,
                instance=spec, placement=self.placement))

    # ------------------------------------------------------------------ lifecycle
    def wait_ready(self, timeout: float = 600.0) -> CoreReady:
        try:
            infos = [c.wait_ready(timeout) for c in self.instances]
        except BaseException:  # a crash, or a ConfigError: the others must not run on
            self.abandon()
            raise
        self._blocks = [info.num_kv_blocks for info in infos]
        for i, info in enumerate(infos):
            if self.roles[i] == "decode":
                self._loads[i] = DecodeLoad(i, info.num_kv_blocks, 0, 0)
        # A request lives on one instance at a time: what it may use (the front end's
        # admission check) is one instance's cache, not the instances' together.
        self.info = dataclasses.replace(
            infos[0], max_model_len=min(i.max_model_len for i in infos),
            num_kv_blocks=min(i.num_kv_blocks for i in infos),
            load_seconds=max(i.load_seconds for i in infos))
        d = self.config.disagg
        log.info("disaggregated: %d prefill + %d decode instances (%d threads each), KV over"
                 " %s, %s dispatch, %s admission, %s predictor", d.num_prefill_instances,
                 d.num_decode_instances, self.config.model.num_threads, d.kv_transport,
                 d.dispatcher, d.decode_admission, d.length_predictor)
        self._broadcast()
        threading.Thread(target=self._monitor, name="fluidserve-cluster-monitor",
                         daemon=True).start()
        return self.info

    @property
    def proc(self):
        """The first instance's process (what a single-core client exposes)."""
        return self.instances[0].proc

    def shutdown(self, timeout: float = 10.0) -> int | None:
        self._stop.set()
        codes = [c.shutdown(timeout) for c in self.instances]
        self._release()
        bad = [c for c in codes if c != 0]
        return bad[0] if bad else 0

    def abandon(self) -> None:
        """End instances that will not be used (start-up failed): see the core client's."""
        for c in self.instances:
            c.abandon()
        self._release()

    def _release(self) -> None:
        """Give back what the deployment holds besides its instances."""
        if self.placement is not None:
            self.placement.close()
            self.placement = None

    def declare_dead(self, message: str) -> None:
        self._die(message)

    def _end_instances(self) -> None:
        for c in self.instances:
            kill_unless_exited(c.proc)

    # ------------------------------------------------------------------ requests
    def fail_all(self, message: str) -> None:
        for i in sorted(self._alive):
            self.instances[i].fail_all(message)

    def force_eos(self, at: set[int]) -> None:
        for c in self.instances:
            c.force_eos(at)

    def inject_fault(self, point: str, times: int = 1, instance: int | None = None) -> None:
        """Testing: ``kv_send`` faults go to the prefill instances, ``kv_recv`` to the decode
        instances, other points to ``instance`` (default: the first)."""
        role = ROLE_FAULTS.get(point)
        targets = [instance] if instance is not None else \
            [i for i, r in enumerate(self.roles) if r == role] if role else [0]
        for i in targets:
            self.instances[i].inject_fault(point, times)

    def _monitor(self) -> None:
        while not self._stop.wait(self.config.disagg.monitor_interval):
            if self._flip_policy is not None:
                self._balance(time.monotonic())
            self._broadcast()
