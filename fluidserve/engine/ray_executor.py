"""The ranks of a tp x pp executor as Ray actors (``--distributed-executor-backend ray``).

Ray only places and starts the rank processes (one placement-group bundle per rank, packed onto
as few nodes as possible) and carries each step's inputs to them; the ranks talk to each other
with torch.distributed exactly as under the ``mp`` launcher (``fluidserve.engine.distributed``).

Cluster: with ``RAY_ADDRESS`` set or a cluster started by ``ray start`` on this node, the
executor joins it; otherwise it starts a local Ray instance (asked for 127.0.0.1, which Ray
resolves to the node's routable address: its services listen as Ray configures them; the
``mp`` backend is the one that keeps a single host's sockets on loopback). Every node must
see the model directory at the same path.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections import deque
from concurrent.futures import Future

from fluidserve.config import ParallelConfig
from fluidserve.core.scheduler.output import SchedulerOutput
from fluidserve.engine.core import ExecutorDead
from fluidserve.engine.distributed import FailsInFlightOnDeath, RankRunner, rank_threads, settle
from fluidserve.model.host_env import ray_actor_env
from fluidserve.model.step_delta import StepEncoder
from fluidserve.model.worker import WorkerSpec
from fluidserve.net import free_port, process_owner

log = logging.getLogger(__name__)


def connect_ray(num_cpus_needed: int):
    """Ray, joined to a running cluster or a local instance started here; and whether this
    call started it (then the executor stops it at shutdown)."""
    try:
        import ray
    except ImportError:
        raise ValueError("the ray backend needs Ray: pip install 'fluidserve[ray]'") from None
    if ray.is_initialized():
        return ray, False
    try:
        ray.init(address="auto", log_to_driver=False)
        log.info("joined the Ray cluster at %s", ray.get_runtime_context().gcs_address)
        return ray, False
    except ConnectionError:
        # Ray's processes die with the thread that started them (PR_SET_PDEATHSIG), and the
        # caller may be a short-lived thread (a server started from a thread pool): start
        # them from a thread that lives as long as this process.
        process_owner().submit(
            ray.init, num_cpus=max(os.cpu_count() or 1, num_cpus_needed),
            include_dashboard=False, _node_ip_address="127.0.0.1",
            object_store_memory=256 << 20, log_to_driver=False).result()
        log.info("started a local Ray instance")
        return ray, True


def describe(e: BaseException) -> str:
    """One line for an error of a rank: a RayTaskError's own cause (its text is the remote
    traceback, in colour, whose first line names only the actor and the task)."""
    cause = getattr(e, "cause", None)
    if isinstance(cause, BaseException):
        e = cause
    lines = [x for x in re.sub(r"\x1b\[[0-9;]*m", "", str(e)).splitlines() if x.strip()]
    return f"{type(e).__name__}: {lines[0].strip()}" if lines else type(e).__name__


class _Rank:
    """The actor body: one rank of the executor."""

    def __init__(self, rank: int, parallel: ParallelConfig, spec: WorkerSpec,
                 threads: int) -> None:
        self.args = (rank, parallel, spec)
        self.threads = threads
        self.runner: RankRunner | None = None

    def address(self) -> tuple[str, int]:
        import ray

        return ray.util.get_node_ip_address(), free_port()

    def start(self, init_method: str) -> int:
        rank, parallel, spec = self.args
        self.runner = RankRunner(rank, parallel, spec, init_method, self.threads)
        return os.getpid()

    def step(self, payload: bytes):
        return self.runner.step(payload)

    def stats(self) -> dict:
        return self.runner.stats()

    def close(self) -> None:
        if self.runner is not None:
            self.runner.close()


class RayExecutor(FailsInFlightOnDeath):
    def __init__(self, spec: WorkerSpec, parallel: ParallelConfig,
                 num_threads: int | None = None, startup_timeout: float = 600.0) -> None:
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        world, tp = parallel.world_size, parallel.tensor_parallel_size
        threads = rank_threads(parallel, num_threads)
        ray, self._own_ray = connect_ray(world * threads)
        self.ray = ray
        self.num_blocks, self.block_size = spec.num_blocks, spec.block_size
        self.max_model_len = spec.max_model_len
        self.pads_rows = spec.pads_rows()
        self.depth = parallel.pipeline_parallel_size
        self.sampler_rank = world - tp
        self.pg, self.actors = None, []
        self._closing = False
        try:  # anything that fails or times out on the way leaves nothing behind
            self.pg = placement_group([{"CPU": threads}] * world, strategy="PACK")
            ray.get(self.pg.ready(), timeout=startup_timeout)
            actor = ray.remote(_Rank)
            self.actors = [
                actor.options(num_cpus=threads, scheduling_strategy=(
                    PlacementGroupSchedulingStrategy(
                        placement_group=self.pg, placement_group_bundle_index=r)),
                    **ray_actor_env()).remote(r, parallel, spec, threads)
                for r in range(world)]
            host, port = ray.get(self.actors[0].address.remote(), timeout=startup_timeout)
            self.pids = ray.get([a.start.remote(f"tcp://{host}:{port}") for a in self.actors],
                                timeout=startup_timeout)
        except Exception as e:
            self._release()  # ranks stuck in start-up would not answer close()
            raise RuntimeError(f"Ray worker ranks failed to start: {type(e).__name__}: {e}"
                               ) from None
        self.dead: str | None = None
        self._lock = threading.Lock()
        self._pending: deque[Future] = deque()
        self._watch: list = []  # refs of every rank's steps, checked for failures
        self._encoder = StepEncoder()
        threading.Thread(target=self._monitor, name="fluidserve-ray-monitor", daemon=True).start()

    def submit(self, plan: SchedulerOutput) -> Future:
        if self.dead is not None:
            raise ExecutorDead(self.dead)
        from fluidserve.model.runner import runner_output

        payload = self._encoder.payload(plan)
        refs = [a.step.remote(payload) for a in self.actors]
        fut: Future = Future()
        rids = plan.sampled_request_ids

        def done(rf: Future) -> None:
            with self._lock:
                if self._pending and self._pending[0] is fut:
                    self._pending.popleft()
            if fut.done():
                return
            try:
                result, seconds = rf.result()
                out = runner_output(rids, result, seconds)
            except Exception as e:
                why = f"a Ray worker rank failed: {describe(e)}"
                settle(fut, error=ExecutorDead(why))  # no longer pending: _die would not
                # Not on this thread (Ray's own callback thread): killing the ranks from it
                # blocks it for good.
                threading.Thread(target=self._die, args=(why,), daemon=True).start()
                return
            settle(fut, out)  # (unless _die or a shutdown failed it meanwhile)

        with self._lock:  # a rank may have died since the check above: _die holds this lock
            if self.dead is not None:
                raise ExecutorDead(self.dead)
            self._pending.append(fut)
            self._watch.extend(refs)
        refs[self.sampler_rank].future().add_done_callback(done)
        return fut

    def stats(self, timeout: float = 30.0) -> list[dict]:
        try:
            return self.ray.get([a.stats.remote() for a in self.actors], timeout=timeout)
        except Exception as e:  # a dead or stuck rank: an error, as from the mp ranks
            raise RuntimeError(self.dead or f"worker rank statistics: {describe(e)}") from None

    def shutdown(self) -> None:
        self._close_down()
        try:
            self.ray.get([a.close.remote() for a in self.actors], timeout=30)
        except Exception:  # dying ranks: they are killed below
            pass
        self._release()

    def _release(self) -> None:
        """Kill the ranks, free their placement group, stop the Ray instance started here
        (each step whatever the one before it met: a dead cluster refuses them all)."""
        self._closing = True
        for step in (self._kill, self._remove_group):
            try:
                step()
            except Exception:
                log.exception("releasing the Ray ranks")
        if self._own_ray:
            self.ray.shutdown()

    def _monitor(self) -> None:
        while self.dead is None and not self._closing:
            with self._lock:
                watch = list(self._watch)
            if not watch:
                threading.Event().wait(0.5)
                continue
            ready, _ = self.ray.wait(watch, num_returns=len(watch), timeout=0.5,
                                     fetch_local=False)
            for ref in ready:
                try:
                    self.ray.get(ref)
                except Exception as e:
                    self._die(f"a Ray worker rank failed: {describe(e)}")
                    return
            with self._lock:
                done = set(ready)
                self._watch = [r for r in self._watch if r not in done]

    def _remove_group(self) -> None:
        if self.pg is not None:
            self.ray.util.remove_placement_group(self.pg)

    def _kill(self) -> None:
        for a in self.actors:
            self.ray.kill(a)
