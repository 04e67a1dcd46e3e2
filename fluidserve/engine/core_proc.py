"""The engine core in a process of its own, and the client the HTTP front end uses to reach it.

As in vLLM v1, the front end (HTTP, tokenizing, detokenizing, streaming) and the engine core
(scheduling and the forward pass) do not share an interpreter, so neither waits on the
other's GIL. They exchange the typed messages of ``fluidserve.engine.messages`` over two
one-way pipes. The core sends one ``EngineCoreOutputs`` per iteration.

Failure handling: if the core process dies or reports a failure (an exception anywhere in its
loop), if the client's own threads fail, or if the front end's watchdog finds the core wedged
(``declare_dead``), the client kills the core, fails every in-flight request with an error the
client sees and calls ``on_dead`` (the server then turns unhealthy and exits non-zero so that a
supervisor restarts it). Nothing waits forever.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import queue
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_ready_objects

from fluidserve.config import ConfigError, EngineConfig, is_config_error
from fluidserve.engine.core import ExecutorDead
from fluidserve.engine.messages import (
    AbortRequests,
    AddRequest,
    AddRequests,
    CoreFailed,
    CoreReady,
    EngineCoreOutputs,
    FailAll,
    ForceEos,
    InjectFault,
    RequestDelta,
    Shutdown,
)
from fluidserve.engine.telemetry import MAX_RECORDS
from fluidserve.model.host_env import spawning_with_huge_page_malloc
from fluidserve.net import ignore_group_signals

log = logging.getLogger(__name__)

IDLE_POLL_S = 0.5
PIPELINE_POLL_S = 0.002


def run_engine_core(config: EngineConfig, inbox: Connection, outbox: Connection,
                    telemetry_file: str | None, max_records: int | None,
                    instance=None) -> None:
    """Entry point of the engine-core process. ``instance``: the core is one instance of a
    disaggregated deployment (``fluidserve.disagg.instance.InstanceSpec``), in its role."""
    ignore_group_signals()
    name = f"{instance.role} {instance.index}" if instance is not None else "core"
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s %(levelname)s %(name)s[{name}]: %(message)s")
    core = role = None
    if not telemetry_file:
        max_records = 0  # nobody will read the records: keep none (a long-lived server's
        # memory would otherwise grow until 100,000 of each were kept)
    try:
        if instance is not None:
            from fluidserve.disagg.instance import start_instance

            core, role = start_instance(config, instance, max_records)
        else:
            core = _start_core(config, max_records)
        ex = core.executor
        outbox.send(CoreReady(str(getattr(core, "model_dir", "")), core.max_model_len,
                              core.vocab_size, ex.num_blocks, ex.block_size,
                              core.load_seconds))
        freeze_startup_heap()
        _busy_loop(core, inbox, outbox, role)
        if role is not None:
            role.close()
        ex.shutdown()
    except BaseException as e:  # report, then exit non-zero: the front end fails requests
        if core is None and is_config_error(e):  # bad input at startup: one line, no trace
            log.debug("cannot start: %s", e)  # (the front end says it, once)
            failed = CoreFailed(str(e), config_error=True)
        else:
            log.exception("engine core failed")
            failed = CoreFailed(f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
        try:
            outbox.send(failed)
        except OSError:
            pass
        if core is not None:
            try:
                core.executor.shutdown()  # worker processes must not outlive the core
            except Exception:
                pass
        os._exit(1)
    if telemetry_file:
        core.telemetry.export_jsonl(telemetry_file)
        log.info("wrote telemetry to %s", telemetry_file)


def freeze_startup_heap() -> None:
    """Move every object alive after start-up (the model's modules, the tokenizer, imported
    code) out of the garbage collector's reach. A full collection otherwise
    walks that whole heap: measured in the engine core of the 213M race model under serving
    load, one took 110 ms, every stream of the running batch stalling for it; after the
    freeze they take ~0.2 ms. The frozen objects stay alive (they would anyway)."""
    import gc

    gc.collect()
    gc.freeze()


def wait_exit(proc, timeout: float = 0.0) -> int | None:
    """``proc``'s exit code once it has exited (waiting up to ``timeout`` s), else None.

    Safe to call from several threads at once, which ``Process.is_alive``/``join`` are not:
    each reaps the child with ``waitpid``, and the thread that loses that race is told the
    child still runs (ECHILD reads as "not yet") until the winner has stored the code; a
    client then kills a PID already reaped, or reports a dead core alive. Here the process's
    sentinel says whether it has exited, and a code being stored is waited for.
    """
    sentinel = getattr(proc, "sentinel", None)
    if sentinel is None:  # a placed core (``RayCoreProcess``): no child of ours to reap
        proc.join(timeout)
        return proc.exitcode
    if not wait_ready_objects([sentinel], timeout):
        return None
    deadline = time.monotonic() + 5.0  # another thread is between waitpid and storing
    while (code := proc.exitcode) is None and time.monotonic() < deadline:
        time.sleep(0.001)
    return code


def kill_unless_exited(proc) -> None:
    """SIGKILL ``proc`` unless its sentinel says it has exited (so not a PID reaped before
    the call; one reaped by another thread during it is as unlikely as with any kill)."""
    if wait_exit(proc) is None:
        proc.kill()


def _start_core(config: EngineConfig, max_records: int | None, scheduler_factory=None):
    from fluidserve.engine.core import EngineCore
    from fluidserve.engine.engine import build_model_executor
    from fluidserve.engine.telemetry import Telemetry

    t0 = time.monotonic()
    executor, model_dir = build_model_executor(config)
    if str(config.model.device).startswith("cpu"):
        # The CPU kernels (the sampler's argmax uses them whatever the attention backend) are
        # built or loaded on first use; do it before reporting ready, so that the first
        # iteration takes an iteration's time and the front end's watchdog can rely on that.
        from fluidserve.kernels import cpu_ops

        cpu_ops()
    vocab = getattr(getattr(executor, "arch", None), "vocab_size", None)
    core = EngineCore(config, executor, telemetry=Telemetry(max_records), vocab_size=vocab,
                      scheduler_factory=scheduler_factory)
    core.collect_stats = True
    core.model_dir = model_dir
    core.load_seconds = time.monotonic() - t0
    return core


def _busy_loop(core, inbox: Connection, outbox: Connection, role=None) -> None:
    """Take in commands, run an iteration, send its outputs; again. A disaggregated
    instance's ``role`` handles the hand-off commands, moves KV between iterations and adds
    its control-plane events to the outputs."""
    from fluidserve.core.scheduler import RequestRejected

    adds_seen = acked = 0  # AddRequests read; of which the front end has been told
    while True:
        pending: list[RequestDelta] = []
        rejected: dict[str, str] = {}
        timeout = 0.0 if _has_work(core, role) else \
            role.poll_interval(IDLE_POLL_S) if role is not None else IDLE_POLL_S
        while inbox.poll(timeout):
            msg = inbox.recv()
            timeout = 0.0
            adds = msg.requests if isinstance(msg, AddRequests) else \
                [msg] if isinstance(msg, AddRequest) else None
            adds_seen += len(adds or ())
            core.trip("command")
            if role is not None and role.handle(msg):
                continue
            if adds is not None:
                for add in adds:
                    try:
                        core.add(add)
                    except RequestRejected as e:
                        rejected[add.request_id] = str(e)
            elif isinstance(msg, AbortRequests):
                core.abort(msg)
            elif isinstance(msg, FailAll):
                pending += core.fail_all(msg.message)
            elif isinstance(msg, Shutdown):  # with what this pass had gathered already
                out = core.make_outputs(pending + core.fail_all("the server is shutting down"))
                out.rejected, out.adds_seen = rejected, adds_seen
                outbox.send(out)
                return
            elif isinstance(msg, ForceEos):
                core.force_eos_at = msg.at
            elif isinstance(msg, InjectFault):
                core.faults[msg.point] = msg.times
        core.trip("loop")
        if (dead := getattr(core.executor, "dead", None)) is not None:
            raise ExecutorDead(dead)  # a worker rank died, idle or not: the server fails now
        if core.faults.get("wedge"):
            _wedge()
        if role is not None:
            pending += role.poll()
        busy = _has_work(core, role)
        # A pipeline with room left does not block on its oldest micro-batch: a request that
        # arrives meanwhile starts the next one (PIPELINE_POLL_S later at most).
        out = core.step(PIPELINE_POLL_S) if busy else core.make_outputs([])
        out.outputs = pending + out.outputs
        out.rejected = rejected
        out.adds_seen = adds_seen
        news = role is not None and role.annotate(out)
        # Requests read and nothing else to say: still a message, the front end's sign that
        # this core is alive and has them (its watchdog counts from there).
        if out.outputs or rejected or out.iteration_tokens or out.finished or news \
                or adds_seen != acked:
            core.trip("send")
            outbox.send(out)
            acked = adds_seen


def _has_work(core, role) -> bool:
    if role is None:
        return core.has_unfinished()
    # An instance's requests waiting for a hand-off are not work: it polls, it does not spin.
    return core.scheduler.has_work() or bool(core.in_flight)


def _wedge() -> None:
    """Testing: stop making progress, as a deadlocked core would, until the parent is gone."""
    parent = os.getppid()
    while os.getppid() == parent:
        time.sleep(0.2)
    os._exit(1)


class EngineCoreClient:
    """The front end's handle on an engine-core process.

    ``on_outputs`` is called on the client's reader thread with each ``EngineCoreOutputs``;
    ``on_dead`` once, with a message, if the core dies or fails.
    """

    def __init__(self, config: EngineConfig, on_outputs: Callable[[EngineCoreOutputs], None],
                 on_dead: Callable[[str], None], telemetry_file: str | None = None,
                 max_records: int | None = MAX_RECORDS, instance=None, placement=None) -> None:
        """``placement``: where to start the core instead of a local process (a
        ``fluidserve.disagg.placement.RayPlacement``); the placed core connects back."""
        name = "fluidserve-engine-core" if instance is None \
            else f"fluidserve-{instance.role}-{instance.index}"
        self.on_outputs, self.on_dead = on_outputs, on_dead
        self.info: CoreReady | None = None
        self.dead: str | None = None
        self._die_lock = threading.Lock()
        self._closing = False  # shutdown() was called: the core's end is expected
        self._abandoned = False  # abandon() was called: nobody is to hear of the core
        self._sendq: queue.SimpleQueue = queue.SimpleQueue()
        if placement is not None:
            self._in_w = self._out_r = None  # until it has connected (``wait_ready``)
            self.proc = placement.start(name, (config, telemetry_file, max_records, instance))
            return
        ctx = mp.get_context("spawn")
        in_r, self._in_w = ctx.Pipe(duplex=False)
        self._out_r, out_w = ctx.Pipe(duplex=False)
        # Not a daemon: it starts worker processes of its own for tp/pp. It exits when its
        # inbox closes, so it never outlives this process.
        self.proc = ctx.Process(target=run_engine_core, name=name,
                                args=(config, in_r, out_w, telemetry_file, max_records,
                                      instance))
        with spawning_with_huge_page_malloc():  # (oneDNN's packed weights on huge pages)
            self.proc.start()
        in_r.close()
        out_w.close()

    def wait_ready(self, timeout: float = 600.0) -> CoreReady:
        """Block until the core has loaded its model; raises RuntimeError if it failed."""
        deadline = time.monotonic() + timeout
        if self._out_r is None:  # one duplex connection, from the placed core
            self._in_w = self._out_r = self.proc.connection(deadline)
        while not self._out_r.poll(0.2):
            if (code := wait_exit(self.proc)) is not None:
                raise RuntimeError(f"engine core exited with code {code} while starting")
            if time.monotonic() > deadline:
                kill_unless_exited(self.proc)
                raise RuntimeError(f"engine core not ready after {timeout:.0f}s")
        try:
            msg = self._out_r.recv()
        except (EOFError, OSError):
            raise RuntimeError(f"engine core exited with code {wait_exit(self.proc, 5)}"
                               " while starting") from None
        if isinstance(msg, CoreFailed):
            if msg.config_error:
                raise ConfigError(msg.message)
            raise RuntimeError(f"engine core failed to start: {msg.message}")
        self.info = msg
        threading.Thread(target=self._read, name="fluidserve-core-reader", daemon=True).start()
        threading.Thread(target=self._write, name="fluidserve-core-writer", daemon=True).start()
        return msg

    # Messages are queued and written by a thread of their own: a long prompt's AddRequest
    # may fill the pipe while the core is mid-iteration, and that must not block the caller.
    def add(self, msg: AddRequest) -> None:
        self._sendq.put(msg)

    def add_many(self, msgs: list[AddRequest]) -> None:
        """Requests in one message (``AddRequests``)."""
        self._sendq.put(AddRequests(msgs))

    def send(self, msg) -> None:
        """Any command (a disaggregated instance's hand-off commands)."""
        self._sendq.put(msg)

    def abort(self, request_ids: list[str], reason: str = "abort") -> None:
        self._sendq.put(AbortRequests(request_ids, reason))

    def fail_all(self, message: str) -> None:
        self._sendq.put(FailAll(message))

    def force_eos(self, at: set[int]) -> None:
        """Testing: see ``messages.ForceEos``."""
        self._sendq.put(ForceEos(frozenset(at)))

    def inject_fault(self, point: str, times: int = 1) -> None:
        """Testing: see ``messages.InjectFault``."""
        self._sendq.put(InjectFault(point, times))

    def shutdown(self, timeout: float = 10.0) -> int | None:
        """Stop the core (it fails what is unfinished); returns its exit code."""
        self._closing = True
        self._sendq.put(Shutdown())
        if (code := wait_exit(self.proc, timeout)) is None:
            kill_unless_exited(self.proc)
            code = wait_exit(self.proc, 5)
        return code

    def abandon(self) -> None:
        """End a core that will not be used (the front end failed while it started): kill
        it and reap it, without ``on_dead``."""
        self._closing = self._abandoned = True
        kill_unless_exited(self.proc)
        wait_exit(self.proc, 5)

    def declare_dead(self, message: str) -> None:
        """Give up on the core (the watchdog found it wedged): kill it, fail everything."""
        self._die(message)

    def _write(self) -> None:
        while True:
            msg = self._sendq.get()
            try:
                self._in_w.send(msg)
            except OSError:
                return  # the core is gone; the reader reports it
            except Exception as e:  # e.g. a message that cannot be pickled
                log.exception("sending %s to the engine core failed", type(msg).__name__)
                self._die(f"could not send to the engine core: {type(e).__name__}: {e}")
                return
            if isinstance(msg, Shutdown):
                return

    def _read(self) -> None:
        # Whatever goes wrong here ends in _die: a reader that stopped silently would leave
        # every stream waiting forever.
        while True:
            try:
                msg = self._out_r.recv()
            except (EOFError, OSError):
                code = wait_exit(self.proc, 2)
                if code == 0 or (self._closing and code is None) or self._abandoned:
                    return  # a clean shutdown (the core may still be exiting)
                self._die(f"the engine core process died (exit code {code})")
                return
            except Exception as e:  # a message that cannot be unpickled
                log.exception("receiving from the engine core failed")
                self._die(f"bad message from the engine core: {type(e).__name__}: {e}")
                return
            if isinstance(msg, CoreFailed):
                self._die(f"the engine core failed: {msg.message.splitlines()[0]}")
                return
            try:
                self.on_outputs(msg)
            except Exception as e:  # the message's outputs are lost: nobody can be trusted
                log.exception("processing engine outputs failed")
                self._die(f"internal error in the front end: {type(e).__name__}: {e}")
                return

    def _die(self, message: str) -> None:
        with self._die_lock:
            if self.dead is not None:
                return
            self.dead = message
        log.error("%s", message)
        kill_unless_exited(self.proc)  # a core that is still running would compute for nobody
        self.on_dead(message)
