"""The instances of a served disaggregated deployment as Ray actors
(``fluidserve serve --disaggregate --distributed-executor-backend ray``).

Ray only places and starts the instances: one placement-group bundle of ``num_threads`` CPUs
per instance, spread over the cluster's nodes (the point of disaggregation: prefill and decode
on hardware of their own) or, with ``--kv-transport shm``, all on one node (shared memory
needs one host). Each actor runs the same engine-core loop as a local instance process
(``fluidserve.engine.core_proc.run_engine_core``); it opens a socket back to the front end
(``multiprocessing.connection``, authenticated with a per-instance key) and from then on the
front end talks to it exactly as to a local process over its pipes. KV moves between the
instances over torch.distributed (gloo) as it does locally: they meet at the rendezvous
store the front end hosts.

Cluster: as for the ray executor (``fluidserve.engine.ray_executor.connect_ray``), a running
cluster (``RAY_ADDRESS`` or ``ray start`` on this node) is joined, else a local Ray instance
is started here and stopped at shutdown. Every node must see the model
directory at the same path.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from multiprocessing.connection import Client, Connection, Listener

from fluidserve.model.host_env import ray_actor_env

log = logging.getLogger(__name__)


class _CoreActor:
    """The actor body: an engine-core process whose pipes are a socket to the front end."""

    def run(self, address: tuple[str, int], authkey: bytes, args: tuple) -> int:
        from fluidserve.engine.core_proc import run_engine_core

        conn = Client(address, authkey=authkey)
        conn.send(os.getpid())
        config, telemetry_file, max_records, instance = args
        run_engine_core(config, conn, conn, telemetry_file, max_records, instance)
        conn.close()
        return 0


class RayCoreProcess:
    """A placed engine core, with the parts of ``multiprocessing.Process``'s interface that
    the core client uses (``is_alive``, ``kill``, ``join``, ``exitcode``, ``pid``, ``name``)."""

    def __init__(self, ray, actor_cls, options: dict, name: str, host: str,
                 args: tuple) -> None:
        self.ray, self.name = ray, name
        self.pid: int | None = None
        self._settled: int | None = None  # the exit code, once the cluster is gone
        key = secrets.token_bytes(16)
        self._listener = Listener((host, 0), authkey=key)
        self._actor = actor_cls.options(**options).remote()
        self._ref = self._actor.run.remote(self._listener.address, key, args)
        # Accepted as soon as it comes: the instances meet in their KV-transport group while
        # starting, so one that waits here would hold up the others.
        self._accepted: list = []
        self._accepting = threading.Thread(target=self._accept, name="fluidserve-ray-accept",
                                           daemon=True)
        self._accepting.start()

    def _accept(self) -> None:
        try:
            self._accepted.append(self._listener.accept())
        except BaseException as e:  # the listener was closed, or authentication failed
            self._accepted.append(e)

    def connection(self, deadline: float) -> Connection:
        """Wait until the actor has connected back: the duplex connection to the core."""
        box = self._accepted
        try:
            while not box:
                if not self.is_alive():
                    raise RuntimeError(f"{self.name} ended while starting: {self._outcome()}")
                if time.monotonic() > deadline:
                    self.kill()
                    raise RuntimeError(f"{self.name} did not connect back in time (is the"
                                       " front end's address reachable from its node?)")
                self._accepting.join(0.2)
        finally:
            self._listener.close()
        conn = box[0]
        if isinstance(conn, BaseException):
            raise RuntimeError(f"{self.name} could not connect back: {conn}")
        self.pid = conn.recv()
        return conn

    def _outcome(self) -> str:
        try:
            return f"returned {self.ray.get(self._ref, timeout=5)}"
        except Exception as e:
            return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"

    def is_alive(self) -> bool:
        if self._settled is not None:
            return False
        ready, _ = self.ray.wait([self._ref], timeout=0)
        return not ready

    def join(self, timeout: float | None = None) -> None:
        if self._settled is None:
            self.ray.wait([self._ref], timeout=timeout)

    @property
    def exitcode(self) -> int | None:
        if self._settled is not None:
            return self._settled
        if self.is_alive():
            return None
        try:
            return self.ray.get(self._ref)
        except Exception:  # the actor died (os._exit, a signal, ray.kill)
            return 1

    def kill(self) -> None:
        if self._settled is None:
            self.ray.kill(self._actor, no_restart=True)

    def settle(self) -> None:
        """Before the cluster goes: keep the outcome (killing the actor if it still runs), so
        that nothing asks Ray about it afterwards."""
        if self._settled is None:
            code = self.exitcode
            if code is None:
                self.kill()
                code = -9
            self._settled = code


class RayPlacement:
    """A placement group of one bundle per instance, and the actors placed on it."""

    def __init__(self, num_instances: int, threads: int, *, same_host: bool,
                 timeout: float = 120.0) -> None:
        from ray.util.placement_group import placement_group

        from fluidserve.engine.ray_executor import connect_ray

        self.ray, self._own_ray = connect_ray(num_instances * threads)
        ray = self.ray
        # The address the instances reach the front end at (its socket, the KV rendezvous).
        self.host = "127.0.0.1" if self._own_ray else ray.util.get_node_ip_address()
        self.threads = threads
        strategy = "STRICT_PACK" if same_host else "SPREAD"
        self.started: list[RayCoreProcess] = []
        self.pg = placement_group([{"CPU": threads}] * num_instances, strategy=strategy)
        try:
            ray.get(self.pg.ready(), timeout=timeout)
        except Exception:
            where = "one node" if same_host else "spread over the nodes"
            message = (f"Ray could not place {num_instances} instances of {threads} CPU(s)"
                       f" each ({strategy}: {where}) within {timeout:.0f}s; the cluster has"
                       f" {ray.cluster_resources().get('CPU', 0):g} CPUs")
            self.close()
            raise RuntimeError(message) from None
        self._actor_cls = ray.remote(_CoreActor)
        log.info("Ray placed %d instances (%s) on a cluster of %d node(s)", num_instances,
                 strategy, len(ray.nodes()))

    def start(self, name: str, args: tuple) -> RayCoreProcess:
        """Start the next bundle's engine core with ``run_engine_core``'s arguments (config,
        telemetry file, max records, instance spec)."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundle = len(self.started)
        options = dict(num_cpus=self.threads, max_restarts=0,
                       scheduling_strategy=PlacementGroupSchedulingStrategy(
                           placement_group=self.pg, placement_group_bundle_index=bundle),
                       **ray_actor_env())
        proc = RayCoreProcess(self.ray, self._actor_cls, options, name, self.host, args)
        self.started.append(proc)
        return proc

    def close(self) -> None:
        for proc in self.started:
            try:
                proc.settle()
            except Exception:
                log.exception("stopping %s", proc.name)
        try:
            self.ray.util.remove_placement_group(self.pg)
        except Exception:  # already gone with the cluster
            pass
        if self._own_ray:
            self.ray.shutdown()
