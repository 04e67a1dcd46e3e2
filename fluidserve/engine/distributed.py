"""Tensor- and pipeline-parallel execution over worker processes (torch.distributed).

World: ``tp x pp`` ranks; rank ``r`` is pipeline stage ``r // tp``, tensor-parallel rank
``r % tp``. Every rank receives every step's ``StepInputs`` from the driver (the engine core) in
the same order; stage ``s`` receives hidden states from stage ``s - 1`` and sends its own on
(point-to-point), the ranks of a stage all-reduce after attention and MLP, and the last stage's
first rank samples and replies. Because each stage processes steps in order, up to ``pp``
steps are in flight at once: the driver's ``submit`` returns a future per step.

Launchers: ``MultiprocExecutor`` starts the ranks as local processes (``mp``);
``fluidserve.engine.ray_executor.RayExecutor`` as Ray actors (``ray``). Both use the rank loop
and the ``RankRunner`` below. A rank that dies makes the executor raise ``ExecutorDead``:
in-flight requests fail with that error and the engine core stops (nothing hangs); surviving
ranks are killed.
"""

from __future__ import annotations

import atexit
import datetime
import logging
import multiprocessing as mp
import os
import pickle
import threading
import time
from collections import deque
from concurrent.futures import Future, InvalidStateError
from multiprocessing.connection import Connection, wait

from fluidserve.config import ParallelConfig
from fluidserve.core.scheduler.output import SchedulerOutput
from fluidserve.engine.core import ExecutorDead
from fluidserve.engine.core_proc import kill_unless_exited, wait_exit
from fluidserve.model.host_env import spawning_with_huge_page_malloc
from fluidserve.model.inputs import prepare_inputs
from fluidserve.model.step_delta import StepDecoder, StepEncoder
from fluidserve.model.worker import WorkerSpec
from fluidserve.net import die_with_parent, local_store, loopback_collectives, process_owner

log = logging.getLogger(__name__)

DIST_TIMEOUT = datetime.timedelta(minutes=10)
# ``init_method`` of ranks that meet at a store their driver hosts (``store://host:port``);
# any other value is torch's own (``tcp://``: the first rank hosts it, on every interface).
DRIVER_STORE = "store://"


def rank_threads(parallel: ParallelConfig, num_threads: int | None) -> int:
    return num_threads or max(1, (os.cpu_count() or 1) // parallel.world_size)


def settle(fut: Future, result=None, error: BaseException | None = None) -> None:
    """Complete ``fut`` unless another thread has (a rank's reply racing its failure)."""
    try:
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)
    except InvalidStateError:
        pass


def check_cuda_ranks(device: str, world_size: int) -> None:
    """Ranks on CUDA take one device each (rank r: device r): enough must be visible, or the
    error is the ranks' own (a division by zero, NCCL refusing a device used twice)."""
    if not device.startswith("cuda"):
        return
    import torch

    seen = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if seen == 0:
        raise ValueError("device 'cuda' requested but torch sees no CUDA device")
    if world_size > seen:
        raise ValueError(f"tensor x pipeline parallelism needs {world_size} CUDA devices, one"
                         f" per rank; torch sees {seen}")


class RankRunner:
    """One rank: joins the process group, loads its shard, runs steps, counts busy time."""

    def __init__(self, rank: int, parallel: ParallelConfig, spec: WorkerSpec,
                 init_method: str, threads: int) -> None:
        import dataclasses

        import torch
        import torch.distributed as dist

        from fluidserve.model.llama import Shard
        from fluidserve.model.worker import Worker

        torch.set_num_threads(threads)
        tp, pp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
        self.rank = rank
        cuda = spec.device.startswith("cuda")
        if cuda:
            device = rank % torch.cuda.device_count()
            # The current device too: Triton launches and CUDA events (the host copy of the
            # sampled tokens) follow it, not the tensors' device.
            torch.cuda.set_device(device)
            spec = dataclasses.replace(spec, device=f"cuda:{device}")
        backend = "nccl" if cuda else "gloo"
        if init_method.startswith(DRIVER_STORE):  # a store the driver hosts on 127.0.0.1
            host, port = init_method.removeprefix(DRIVER_STORE).rsplit(":", 1)
            store = dist.TCPStore(host, int(port), tp * pp, is_master=False,
                                  timeout=DIST_TIMEOUT)
            dist.init_process_group(backend, store=store, rank=rank, world_size=tp * pp,
                                    timeout=DIST_TIMEOUT)
        else:
            dist.init_process_group(backend, init_method=init_method, rank=rank,
                                    world_size=tp * pp, timeout=DIST_TIMEOUT)
        groups = [dist.new_group(list(range(s * tp, (s + 1) * tp))) for s in range(pp)]
        shard = Shard(rank % tp, tp, rank // tp, pp)
        self.samples = shard.last and shard.tp_rank == 0
        group = groups[shard.pp_rank] if tp > 1 else None
        host = None
        if group is not None and not cuda and not parallel.disable_custom_all_reduce:
            from fluidserve.model.host_all_reduce import HostAllReduce

            host = HostAllReduce.create(group)
        # (what its tensor-parallel group all-reduces through: None without one)
        self.all_reduce = None if group is None else "gloo" if host is None else "shared memory"
        if group is not None:
            log.info("tensor-parallel all-reduce: %s", self.all_reduce)
        self.worker = Worker(spec, shard, group, host)
        self.block_size = spec.block_size
        self.decoder = StepDecoder()  # this rank's mirror of the requests it runs
        self.busy = 0.0
        self.started = time.monotonic()

    def step(self, payload: bytes):
        """Run one step: ``payload`` is a pickled ``StepDelta``."""
        t0 = time.perf_counter()
        plan = self.decoder.decode(pickle.loads(payload))
        out = self.worker.execute(prepare_inputs(plan, self.block_size))
        dt = time.perf_counter() - t0
        self.busy += dt - self.worker.comm_wait  # computing, not waiting on another stage
        return (out, dt) if out is not None else None

    def stats(self) -> dict:
        return {"rank": self.rank, "busy_s": self.busy, "wall_s": time.monotonic() - self.started,
                "all_reduce": self.all_reduce}

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def rank_main(rank: int, parallel: ParallelConfig, spec: WorkerSpec, init_method: str,
              threads: int, inbox: Connection, outbox: Connection, driver: int) -> None:
    """Entry point of one rank process of the mp launcher: it dies with its driver (pid
    ``driver``), and its sockets stay on the loopback interface."""
    from fluidserve.engine.core_proc import freeze_startup_heap
    from fluidserve.net import ignore_group_signals

    die_with_parent(driver)
    ignore_group_signals()
    loopback_collectives()
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s %(levelname)s %(name)s[rank {rank}]: %(message)s")

    def reply(msg) -> None:
        try:
            outbox.send(msg)
        except OSError:
            os._exit(1)  # the driver is gone

    try:
        runner = RankRunner(rank, parallel, spec, init_method, threads)
        freeze_startup_heap()
        reply(("ready", rank))
        while True:
            try:
                kind, payload = pickle.loads(inbox.recv_bytes())
            except (EOFError, OSError):
                os._exit(1)  # the driver is gone
            if kind == "step":
                out = runner.step(payload)
                if out is not None:
                    reply(("result", out))
            elif kind == "stats":
                reply(("stats", (payload, runner.stats())))
            elif kind == "shutdown":
                runner.close()
                return
    except BaseException as e:  # an OSError of its own (a full disk) included: reported
        log.exception("rank %d failed", rank)
        try:
            outbox.send(("failed", f"rank {rank}: {type(e).__name__}: {e}"))
        except OSError:
            pass
        os._exit(1)


def died_starting(rank: int, code) -> RuntimeError:
    """A rank that exited before it could say why: most often a script without a main guard,
    which spawn runs again in the rank (it then refuses to start processes of its own)."""
    return RuntimeError(f"worker rank {rank} exited with code {code} while starting, before it"
                        " could report an error (its output is above; a script that starts"
                        " tensor or pipeline parallel ranks must start them under"
                        " `if __name__ == '__main__':`, since each rank imports it again)")


class FailsInFlightOnDeath:
    """What an executor of worker ranks does when one dies: the first report wins, every
    batch in flight fails with ExecutorDead, and the remaining ranks are stopped
    (``_kill``). Needs ``_lock``, ``dead``, ``_closing`` and ``_pending`` (futures, or
    tuples whose first item is the future)."""

    def _die(self, message: str) -> None:
        with self._lock:
            if self.dead is not None or self._closing:
                return
            self.dead = message
            pending, self._pending = list(self._pending), deque()
        log.error("%s: failing %d batches in flight", message, len(pending))
        self._fail(pending, message)
        self._kill()

    def _close_down(self) -> None:
        """At shutdown: later batches are refused, and those still in flight (a close from
        another thread, or after an interrupted step) fail, rather than wait for ever."""
        with self._lock:
            self._closing = True
            if self.dead is None:
                self.dead = "the executor was shut down"
            pending, self._pending = list(self._pending), deque()
        self._fail(pending, self.dead)

    @staticmethod
    def _fail(pending: list, message: str) -> None:
        for item in pending:
            settle(item[0] if isinstance(item, tuple) else item, error=ExecutorDead(message))

    def _kill(self) -> None:
        raise NotImplementedError


class MultiprocExecutor(FailsInFlightOnDeath):
    """The ranks as local processes (``--distributed-executor-backend mp``)."""

    def __init__(self, spec: WorkerSpec, parallel: ParallelConfig,
                 num_threads: int | None = None, startup_timeout: float = 600.0) -> None:
        self.spec, self.parallel = spec, parallel
        self.num_blocks, self.block_size = spec.num_blocks, spec.block_size
        self.max_model_len = spec.max_model_len
        self.pads_rows = spec.pads_rows()
        self.depth = parallel.pipeline_parallel_size
        world, tp = parallel.world_size, parallel.tensor_parallel_size
        self.sampler_rank = world - tp  # last stage, tensor-parallel rank 0
        ctx = mp.get_context("spawn")
        self._store = local_store(world)
        init = f"{DRIVER_STORE}127.0.0.1:{self._store.port}"
        threads = rank_threads(parallel, num_threads)
        check_cuda_ranks(spec.device, world)
        self.procs, self.inboxes, self.outboxes = [], [], []
        self.dead: str | None = None
        self._closing = False
        self._pending: deque[tuple[Future, list[str]]] = deque()
        self._stats: deque = deque()  # (call, statistics) from the sampling rank
        self._stats_calls = 0
        self._lock = threading.Lock()
        self._encoder = StepEncoder()
        try:  # an error or an interrupt at any point leaves no rank behind
            with spawning_with_huge_page_malloc():  # (oneDNN's packed weights on huge pages)
                for rank in range(world):
                    in_r, in_w = ctx.Pipe(duplex=False)
                    out_r, out_w = ctx.Pipe(duplex=False)
                    p = ctx.Process(target=rank_main, name=f"fluidserve-rank-{rank}", daemon=True,
                                    args=(rank, parallel, spec, init, threads, in_r, out_w,
                                          os.getpid()))
                    started = process_owner().submit(p.start)  # see die_with_parent
                    try:
                        started.result()
                    except BaseException:  # (an interrupt) a start under way is waited for
                        if not started.cancel() and started.exception() is None:
                            self.procs.append(p)  # it started: killed below
                        raise
                    in_r.close()
                    out_w.close()
                    self.procs.append(p)
                    self.inboxes.append(in_w)
                    self.outboxes.append(out_r)
            self._wait_ready(startup_timeout)
        except BaseException:
            self._kill()
            self._store = None
            raise
        # The ranks ignore SIGTERM and multiprocessing joins them at exit: a driver that
        # never calls shutdown (an LLM not closed) would wait for them for ever.
        atexit.register(self.shutdown)
        threading.Thread(target=self._read, name="fluidserve-ranks-reader", daemon=True).start()

    def _wait_ready(self, timeout: float) -> None:
        waiting = set(range(len(self.procs)))
        deadline = time.monotonic() + timeout
        while waiting:
            conns = [self.outboxes[r] for r in waiting]
            ready = wait(conns + [self.procs[r].sentinel for r in waiting], timeout=1.0)
            for r in list(waiting):
                if self.outboxes[r] in ready:
                    try:
                        msg = self.outboxes[r].recv()
                    except (EOFError, OSError):  # it died: its pipe closed before its sentinel
                        raise died_starting(r, wait_exit(self.procs[r], 5)) from None
                    if msg[0] != "ready":
                        raise RuntimeError(f"worker rank {r} failed to start: {msg[1]}")
                    waiting.discard(r)
                elif self.procs[r].sentinel in ready:
                    raise died_starting(r, wait_exit(self.procs[r], 1))
            if waiting and time.monotonic() > deadline:
                raise RuntimeError(f"worker ranks {sorted(waiting)} not ready after {timeout}s")

    # ------------------------------------------------------------------ driver side
    def submit(self, plan: SchedulerOutput) -> Future:
        if self.dead is not None:
            raise ExecutorDead(self.dead)
        payload = pickle.dumps(("step", self._encoder.payload(plan)),
                               protocol=pickle.HIGHEST_PROTOCOL)
        fut: Future = Future()
        with self._lock:  # a rank may have died since the check above: _die holds this lock
            if self.dead is not None:
                raise ExecutorDead(self.dead)
            self._pending.append((fut, plan.sampled_request_ids))
        try:
            for conn in self.inboxes:
                conn.send_bytes(payload)
        except OSError:
            self._die("a worker rank's pipe closed")
        except BaseException:  # (an interrupt) some ranks may have the step and others not:
            self._die("interrupted while sending a batch to the worker ranks")  # out of step
            raise
        return fut

    def stats(self, timeout: float = 30.0) -> list[dict]:
        """Per rank: busy seconds (computing steps) and wall seconds since it started."""
        # Each call's number comes back with its replies: a reply that came after an earlier
        # call had given up is skipped, not taken for this call's.
        self._stats_calls = call = self._stats_calls + 1
        msg = pickle.dumps(("stats", call))
        try:
            if self.dead is not None:
                raise OSError
            for conn in self.inboxes:
                conn.send_bytes(msg)
        except OSError:
            raise RuntimeError(self.dead or "a worker rank's pipe closed") from None
        out = []
        deadline = time.monotonic() + timeout
        for r, conn in enumerate(self.outboxes):
            if r == self.sampler_rank:  # (its pipe is read by the reader thread)
                while time.monotonic() < deadline and self.dead is None:
                    while self._stats and self._stats[0][0] != call:
                        self._stats.popleft()
                    if self._stats:
                        break
                    time.sleep(0.01)
                if not self._stats:
                    raise RuntimeError(self.dead or f"worker rank {r} sent no statistics"
                                       f" within {timeout:g}s")
                out.append(self._stats.popleft()[1])
                continue
            while True:
                if not conn.poll(max(0.0, deadline - time.monotonic())):
                    raise RuntimeError(f"worker rank {r} sent no statistics within"
                                       f" {timeout:g}s")
                try:
                    kind, body = conn.recv()
                except (EOFError, OSError):
                    kind, body = "failed", f"rank {r}: pipe closed"
                if kind != "stats":
                    raise RuntimeError(f"worker {body}")
                if body[0] == call:
                    out.append(body[1])
                    break
        return out

    def shutdown(self) -> None:
        atexit.unregister(self.shutdown)
        if self._closing:
            return
        self._close_down()
        msg = pickle.dumps(("shutdown", None))
        for conn in self.inboxes:
            try:
                conn.send_bytes(msg)
            except OSError:
                pass
        try:
            for p in self.procs:
                wait_exit(p, 10)
        finally:
            self._kill()
            self._store = None  # the rendezvous store stops listening

    def _kill(self) -> None:
        # The reader thread may be waiting on the same ranks: wait_exit, not join/is_alive.
        for p in self.procs:
            kill_unless_exited(p)
            wait_exit(p, 5)

    def _read(self) -> None:
        try:
            self._read_outputs()
        except Exception as e:  # else every batch in flight would wait for ever
            log.exception("reading the worker ranks' outputs failed")
            self._die(f"reading the worker ranks' outputs failed: {type(e).__name__}: {e}")

    def _read_outputs(self) -> None:
        from fluidserve.model.runner import runner_output

        conn = self.outboxes[self.sampler_rank]
        sentinels = {p.sentinel: r for r, p in enumerate(self.procs)}
        while self.dead is None:
            ready = wait([conn, *sentinels])
            if conn in ready:
                try:
                    kind, body = conn.recv()
                except (EOFError, OSError):  # the sampling rank died: say how
                    if self._closing:
                        return
                    r = self.sampler_rank
                    code = wait_exit(self.procs[r], 5)
                    self._die(f"worker rank {r} died (exit code {code})" if code is not None
                              else f"worker rank {r}: its pipe closed")
                    return
                if kind == "result":
                    result, seconds = body
                    with self._lock:
                        if not self._pending:  # shut down meanwhile: the batch has failed
                            continue
                        fut, rids = self._pending.popleft()
                    fut.set_result(runner_output(rids, result, seconds))
                    continue
                if kind == "stats":
                    self._stats.append(body)
                    continue
                self._die(f"worker {body}")
                return
            for s in ready:
                if s in sentinels:
                    if self._closing:
                        return
                    r = sentinels[s]
                    self._die(self._last_words(r) or f"worker rank {r} died (exit code"
                              f" {wait_exit(self.procs[r], 1)})")
                    return

    def _last_words(self, rank: int) -> str | None:
        """The error a rank that died reported on its way out, if it did (only the sampling
        rank's pipe is read while it runs)."""
        conn = self.outboxes[rank]
        try:
            while conn.poll():
                kind, body = conn.recv()
                if kind == "failed":
                    return f"worker {body}"
        except (EOFError, OSError):
            pass
        return None

